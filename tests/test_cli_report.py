"""What the command says after an answer (issue 28 item 14): plain decoding's rate beside every run (self-tuned,
--fixed-steps, --no-lookahead), why self-tuned steps stayed plain, and --compare (plain and lookahead timed in one
process after one load); and what it refuses of its input (item 7): a prompt that is not UTF-8. On the tiny model
with a stand-in tokenizer, so no default model is needed."""

from __future__ import annotations

import pytest

import lookahead.cli.generate as cli_generate
from helpers import CharTokenizer
from lookahead import LookaheadConfig
from lookahead.cli import main
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
    assert " tok/s (plain ~" in err[-1] and "tok/s here)" in err[-1]


def test_a_mostly_plain_self_tuned_run_says_why(tiny_cli, capsys):
    # a 2-token step costs 5 one-token ones: nothing the drafts offer pays, so every step but the probes is plain
    tiny_cli.cost_model = CostModel({"greedy": Curve([1, 2, 64], [0.01, 0.05, 0.6], [0.0, 0.0, 0.0])})
    code, err = run(capsys)
    assert code == 0
    assert "steps plain: multi-token steps are dear here (a busy or slow machine)" in err[-1]
    assert "-token step costs" in err[-1]


def test_compare_times_plain_and_lookahead_after_one_load(tiny_cli, capsys):
    code, err = run(capsys, "--compare")
    assert code == 0, err
    plain, ahead, verdict = err[-3:]
    assert plain.startswith("[plain] 24 tokens, 24 steps, S=1.00") and ahead.startswith("[lookahead W=1 N=4 G=5")
    assert verdict.startswith("lookahead / plain: ") and verdict.endswith("tok/s, the same tokens)")
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
