"""What the command says after an answer (issue 28 item 14): plain decoding's rate beside every run (self-tuned,
--fixed-steps, --no-lookahead), why self-tuned steps stayed plain, and --compare (plain and lookahead timed in one
process after one load); and what it refuses of its input (item 7): a prompt that is not UTF-8. On the tiny model
with a stand-in tokenizer, so no default model is needed."""

from __future__ import annotations

import re

import pytest

import lookahead.cli.generate as cli_generate
from helpers import CharTokenizer
from lookahead import LookaheadConfig
from lookahead.cli import main
from lookahead.cli.report import Timed, comparison, whole_answer_rate, why_slower
from lookahead.loop import GenerationResult
from lookahead.models import Llama
from lookahead.tuning import CostModel, Curve


@pytest.fixture
def tiny_cli(tiny_checkpoint, monkeypatch):
    """The command's `load` gives the tiny model (the one it returns, to set a cost model on) and CharTokenizer."""
    model = Llama.from_pretrained(tiny_checkpoint())

    def load(args, parallel, say):
        budget = "fixed" if args.fixed_steps else "auto"
        return model, CharTokenizer(), None if args.no_lookahead else LookaheadConfig(budget=budget)

    monkeypatch.setattr(cli_generate, "load", load)
    return model


def run(capsys, *argv) -> tuple[int, list[str]]:
    code = main(["generate", "abcabcabcabc", "--raw", "--max-new-tokens", "24", *argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flags", [[], ["--fixed-steps"], ["--no-lookahead"]], ids=["self-tuned", "fixed", "plain"])
def test_every_run_shows_plain_decodings_rate_here(tiny_cli, capsys, flags):
    code, err = run(capsys, *flags)
    assert code == 0 and err[-1].startswith("[plain]" if flags == ["--no-lookahead"] else "[lookahead W=1 N=4 G=5")
    assert " tok/s (float32; plain ~" in err[-1] and "tok/s here)" in err[-1]


class FrozenCost(CostModel):
    """Costs that the steps do not change (the real ones would learn the tiny model's timings)."""

    def observe(self, tokens: int, length: int, seconds: float, kind: str = "greedy") -> None:
        pass


def test_a_mostly_plain_self_tuned_run_says_why(tiny_cli, capsys):
    # a 2-token step costs 5 one-token ones: nothing the drafts offer pays, so every step but the explorations is plain
    tiny_cli.cost_model = FrozenCost({"greedy": Curve([1, 2, 64], [0.01, 0.05, 0.6], [0.0, 0.0, 0.0])})
    code, err = run(capsys)
    assert code == 0
    assert "steps fell back to plain because multi-token steps are dear here (a busy or slow machine)" in err[-1]
    assert "-token step costs" in err[-1]


def test_a_run_slower_than_plain_says_so_and_why(tiny_cli, capsys, monkeypatch):
    """Issue 36 item 4: where lookahead was slower than plain decoding here, the summary line says by how much and
    why. Plain decoding is timed at a hundred thousand tokens a second here (the probe made to say so), so lookahead
    loses whatever the machine; a pass costs what the cost model says, so the rest of each step is the loop's."""
    tiny_cli.cost_model = FrozenCost({"greedy": Curve([1, 2, 64], [1e-5, 2e-5, 6e-4], [0.0, 0.0, 0.0])})
    monkeypatch.setattr(cli_generate, "probe_plain", lambda model, prompt_ids: 1e5)
    code, err = run(capsys)
    assert code == 0
    line = err[-1]
    # the plain rate said as a whole answer is timed (its prefill in it: below 100,000), the verdict on decoding alone
    assert re.search(r"\(float32; plain ~\d+ tok/s here\); lookahead was 0\.0\d+x plain here: ", line), line
    assert "the loop's own work per step (drafting, checking)" in line and " plain steps' time" in line


def rate_of(line: str) -> tuple[float, float | None]:
    """(the summary line's tokens/s, its "plain ~N tok/s here" or None)."""
    rate = float(line.split(" tok/s")[0].rsplit(", ", 1)[1])
    plain = line.split("plain ~")[1].split(" tok/s")[0] if "plain ~" in line else None
    return rate, None if plain is None else float(plain)


@pytest.mark.parametrize("flags", [[], ["--fixed-steps"]], ids=["self-tuned", "fixed"])
def test_the_plain_rate_beside_lookahead_is_plain_decoding_timed_now(tiny_cli, capsys, flags):
    """Issue 49 item 1: the verdict compared with the cost model's plain rate, the forward pass alone as measured once,
    1.1-2.9x above what --no-lookahead measured right after. Here the cost model says 100,000 tok/s; the line's plain
    rate is a plain continuation timed in this run (the loop's own work in it), so it is what a --no-lookahead run of
    the same model measures. (Their ratio within 20% would be flaky on a busy 2-core machine, where runs a second
    apart differ by more: the plain rate is held to the measured one within 2x, against the cost model's 100,000.)"""
    tiny_cli.cost_model = FrozenCost({"greedy": Curve([1, 2, 64], [1e-5, 2e-5, 6e-4], [0.0, 0.0, 0.0])})
    code, err = run(capsys, *flags)
    assert code == 0, err
    _, estimate = rate_of(err[-1])
    measured = sorted(rate_of(run(capsys, "--no-lookahead")[1][-1])[0] for _ in range(3))[1]
    assert estimate is not None and estimate < 20_000 and 0.5 < estimate / measured < 2.0, (estimate, measured)


def test_the_probes_plain_rate_is_said_as_a_whole_answer_is_timed():
    """Issue 49 item 1: the summary's tokens/s include the prefill, the probe's plain rate does not; beside it the
    plain rate is the whole answer's (11 tokens: the first after 1 s, ten more at 10 tok/s: 11 in 2 s)."""
    assert whole_answer_rate(10.0, 11, 1.0) == 5.5
    assert whole_answer_rate(10.0, 11, None) == 10.0 and whole_answer_rate(None, 11, 1.0) is None


def test_the_probe_times_plain_decoding_from_its_first_token_to_its_last(monkeypatch):
    """`probe_plain`'s rate is the tokens after the first over the time from the first to the last: a model whose
    first token comes after a 5 s prefill and each of 15 more 0.1 s after the one before decodes at 10 tok/s (not
    16 tokens over 1.5 s, nor anything with the prefill in it). On a clock that the model's steps move."""
    import types

    import lookahead.cli.report as report

    now = [0.0]
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Stepped:
        def generate(self, prompt_ids, max_new_tokens, eos_token_id, stream):
            assert eos_token_id == [] and max_new_tokens == 16  # (the continuation never stops early)
            for i in range(max_new_tokens):
                now[0] += 5.0 if i == 0 else 0.1
                stream([7])

    assert report.probe_plain(Stepped(), [1, 2, 3]) == pytest.approx(10.0)


def result_of(step_tokens: list[int], step_sizes: list[int]) -> GenerationResult:
    """A result whose prefill gave one token and whose decoding steps gave `step_tokens` tokens."""
    gave = [[0]] + [[0] * n for n in step_tokens]
    return GenerationResult(tokens=[0] * sum(map(len, gave)), steps=len(gave), step_tokens=gave,
                            step_sizes=step_sizes)


def test_why_slower_names_the_cause():
    """Lookahead's rate is plain's times S over a step's time in plain steps: it loses where its steps took longer
    than the tokens they gave, and the line says which cause: steps fallen back to plain (the loop's own work not
    repaid), drafts seldom right, or multi-token passes dear here."""
    mostly_plain = result_of([1] * 9 + [2], [1] * 9 + [5])
    assert why_slower(mostly_plain, 80.0, 100.0, "9 of 10 steps fell back to plain because X") == (
        "lookahead was 0.80x plain here: 9 of 10 steps fell back to plain because X; the loop's own work per step "
        "(drafting, checking) was not repaid (a step gave 1.10 tokens and took 1.38 plain steps' time)")
    weak = result_of([1, 2, 1, 1], [18] * 4)
    assert why_slower(weak, 50.0, 100.0) == ("lookahead was 0.50x plain here: the drafts were seldom right on this "
                                             "text (a step gave 1.25 tokens and took 2.50 plain steps' time)")
    dear = result_of([3, 3, 2, 4], [18] * 4)
    assert why_slower(dear, 90.0, 100.0, passes=3.2) == (
        "lookahead was 0.90x plain here: multi-token passes are dear here, a busy or slow machine (a step gave 3.00 "
        "tokens and took 3.33 plain steps' time)")
    assert why_slower(dear, 90.0, 100.0, passes=1.1) == (
        "lookahead was 0.90x plain here: the loop's own work per step (drafting, checking) took most of each step "
        "(a step gave 3.00 tokens and took 3.33 plain steps' time, its pass 1.10)")
    assert why_slower(dear, 100.0, 100.0) is None and why_slower(dear, 120.0, None) is None
    assert why_slower(dear, None, 100.0) is None


def test_compare_says_why_lookahead_lost():
    plain = result_of([1] * 10, [])
    weak = result_of([1, 2, 1, 1, 1, 1, 1, 1, 1], [18] * 9)
    assert comparison(Timed(plain, 1.0), Timed(weak, 2.0), True) == (
        "lookahead / plain: 0.50x (5.5 against 11.0 tok/s, the same tokens); lookahead was 0.50x plain here: the "
        "drafts were seldom right on this text (a step gave 1.11 tokens and took 2.22 plain steps' time)")
    assert comparison(Timed(plain, 2.0), Timed(weak, 1.0), False) == "lookahead / plain: 2.00x (11.0 against 5.5 tok/s)"


def test_compare_times_plain_and_lookahead_after_one_load(tiny_cli, capsys):
    code, err = run(capsys, "--compare")
    assert code == 0, err
    plain, ahead, verdict = err[-3:]
    assert plain.startswith("[plain] 24 tokens, 24 steps, S=1.00") and ahead.startswith("[lookahead W=1 N=4 G=5")
    assert verdict.startswith("lookahead / plain: ") and "tok/s, the same tokens)" in verdict
    slower = float(verdict.split()[3].rstrip("x")) < 1.0  # on this machine, now: either way, said plainly
    assert ("x plain here: " in verdict) == slower and (slower or verdict.endswith("tok/s, the same tokens)"))
    assert any("plain decoding first, timed for the comparison" in line for line in err)


def test_compare_needs_lookahead(capsys):
    assert main(["generate", "x", "--compare", "--no-lookahead"]) == 2
    assert "--compare times plain decoding against lookahead decoding" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_refused_by_name(capsys):
    """A command line in another encoding reaches Python as lone surrogates; the tokenizer failed on them."""
    assert main(["generate", "caf\udce9 au lait"]) == 2
    assert capsys.readouterr().err.strip() == ("lookahead: error: the prompt is not valid UTF-8 (byte 0xe9 at "
                                               "character 3); give it in UTF-8")


def test_an_unwritable_cache_is_one_warning_line_and_the_answer_stands(tiny_cli, capsys, tmp_path, monkeypatch):
    """Issue 28 item 3: the command refused a checkpoint with '[Errno 13] .../.cache' and no reason."""
    from lookahead.tuning import store

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(store, "_WARNED", set())
    code, err = run(capsys)
    assert code == 0 and err[-1].startswith("[lookahead W=1 N=4 G=5, self-tuned] 24 tokens")
    warned = [line for line in err if line.startswith("lookahead: warning: ")]
    assert len(warned) == 1 and "cannot keep the measured step costs in" in warned[0]
    assert "set LOOKAHEAD_CACHE_DIR to a writable folder" in warned[0]


def test_the_summary_names_the_peers_figures_measured_on_this_cpu(tiny_cli, capsys):
    """bench/peers.py's one-request figures (issue 36 item 4), where it ran on this kind of CPU: the same dtype's
    first; a file from another CPU says nothing."""
    import json

    from lookahead.cli.report import PEERS_FILE
    from lookahead.kernels.cpu_kernels import cpu_tag
    from lookahead.paths import cache_root

    path = cache_root() / PEERS_FILE
    figures = {"llama.cpp bfloat16": 43.4, "llama.cpp float32": 22.1, "vLLM float32": 12.0}
    try:
        path.write_text(json.dumps({"cpu_tag": cpu_tag(), "date": "2026-11-27 10:00", "figures": figures}))
        code, err = run(capsys, "--no-lookahead")
        assert code == 0
        assert "; llama.cpp float32 ~22, vLLM float32 ~12 tok/s here by bench/peers.py on 2026-11-27)" in err[-1]
        for other in (json.dumps({"cpu_tag": "another", "date": "2026-11-27 10:00", "figures": figures}), "{cut"):
            path.write_text(other)  # another CPU's figures, or a file cut short: the line goes on without them
            code, err = run(capsys, "--no-lookahead")
            assert code == 0 and "peers" not in err[-1]
    finally:
        path.unlink(missing_ok=True)


def test_step_costs_are_said_measured_only_when_they_were(tiny_checkpoint, capsys, monkeypatch, tmp_path):
    """The first run on a machine measures the step costs and says so; the next process (a fresh model, the cost file
    read) measured nothing and says nothing (every warm run said "measured ... (once per machine and model)")."""
    from lookahead.paths import cache_root

    (tmp_path / "kernels").symlink_to(cache_root() / "kernels")  # an empty cache folder but the built kernels
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path))
    models = [Llama.from_pretrained(tiny_checkpoint()) for _ in range(2)]
    monkeypatch.setattr(cli_generate, "load", lambda args, parallel, say: (models.pop(0), CharTokenizer(),
                                                                          LookaheadConfig()))
    said = [[line for line in run(capsys)[1] if "measured this machine's step costs" in line] for _ in range(2)]
    assert len(said[0]) == 1 and said[1] == []
