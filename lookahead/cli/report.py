"""What the command says after an answer: the summary line (the method, tokens, forward passes, S, tokens/s), plain
decoding's rate on this machine beside it, why self-tuned steps stayed plain where most did, where lookahead was
slower than plain decoding by how much and why (`why_slower`), and `--compare`'s lines (plain and lookahead timed in
one process, after one load).

A newcomer's first question is whether lookahead paid here. Plain decoding's rate beside a lookahead answer is timed
in the same run by a short plain continuation of the prompt (`probe_plain`: `PROBE_TOKENS` one-token steps, the
prompt's prefix cached, the loop's own work included), so every run shows it: self-tuned, `--fixed-steps`,
`--no-lookahead` (its own rate) and torchrun's rank 0. Not the cost model's rate: that is the forward pass alone,
measured once per machine, and was 1.1-2.9x above what `--no-lookahead` measured right after (issue 49); `lookahead
chat` shows no plain figure (a probe every turn would cost each turn its time).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

PEERS_FILE = "peers.json"  # bench/peers.py's one-request figures for this CPU, in the cache folder
PROBE_TOKENS = 16  # plain steps timed for the baseline where no cost model gives it
MOSTLY_PLAIN = 0.5  # a self-tuned run with more plain steps than this says why
BUSY = 1.5  # a lookahead step costing this many one-token steps or more: multi-token passes are slow here
WEAK = 1.5  # lookahead steps giving fewer tokens than this: the drafts do not pay
LOOP = 2.0  # steps taking this many times what their pass costs: the loop's own work is what is slow


@dataclass(frozen=True)
class Timed:
    """A generation's result and the seconds it took."""

    result: Any
    seconds: float

    @property
    def rate(self) -> float:
        return len(self.result.tokens) / self.seconds


@dataclass(frozen=True)
class Notes:
    """What the summary line says beside a run's own figures: the model's `dtype`, `plain_rate` what plain decoding
    does on this machine, `peers` (`peer_rates`) what the engines people already run do here, and `why`
    (`why_plain`) where self-tuned steps stayed plain."""

    dtype: str | None = None
    plain_rate: float | None = None
    peers: str | None = None
    why: str | None = None


def summary(run: Timed, lookahead=None, ranks: int = 1, notes: Notes = Notes()) -> str:
    """The line after an answer: the method, tokens, forward passes, S, tokens/s, and its `notes`."""
    result = run.result
    mode = "plain" if lookahead is None else f"lookahead W={lookahead.window} N={lookahead.ngram} G={lookahead.guesses}"
    if ranks > 1:
        mode += f" on {ranks} processes"
    elif lookahead is not None and lookahead.budget == "auto":
        mode += ", self-tuned"
    line = (f"[{mode}] {len(result.tokens)} tokens, {result.steps} steps, S={result.compression:.2f}, "
            f"{run.rate:.1f} tok/s")
    said = [] if notes.dtype is None else [notes.dtype]
    if notes.plain_rate is not None:
        said.append(f"plain ~{notes.plain_rate:.0f} tok/s here")
    if notes.peers is not None:
        said.append(notes.peers)
    if said:
        line += f" ({'; '.join(said)})"
    return line if notes.why is None else f"{line}; {notes.why}"


def dtype_name(model) -> str:
    """The model's dtype as the flags name it ("bfloat16")."""
    return str(model.dtype).removeprefix("torch.")


def dtype_choice(model) -> str | None:
    """Why the model runs in its dtype where the default chose it (`Llama.dtype_reason`), and how to choose another;
    None where --dtype named it."""
    reason = getattr(model, "dtype_reason", None)
    if reason in (None, "asked for"):
        return None
    other = "bfloat16" if dtype_name(model) == "float32" else "float32"
    return f"{dtype_name(model)} by default here: {reason} (--dtype {other} for {other})"


def peer_rates(dtype: str) -> str | None:
    """What llama.cpp (and vLLM) decode one request at here, by `bench/peers.py`'s last run on this kind of CPU
    (`peers.json` in the cache folder; None where it has not run here): the same dtype's figures first."""
    from lookahead.kernels.cpu_kernels import cpu_tag
    from lookahead.paths import cache_root

    root = cache_root()
    try:
        saved = json.loads((root / PEERS_FILE).read_text()) if root is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("cpu_tag") != cpu_tag() or not saved.get("figures"):
        return None
    figures = sorted(saved["figures"].items(), key=lambda item: not item[0].endswith(dtype))
    rates = ", ".join(f"{name} ~{rate:.0f}" for name, rate in figures[:2])
    return f"{rates} tok/s here by bench/peers.py on {saved.get('date', '?')[:10]}"


def probe_plain(model, prompt_ids: list[int], tokens: int = PROBE_TOKENS) -> float:
    """Tokens per second of plain decoding here, timed: a plain continuation of the prompt (whose prefix the answer
    left cached), from its first token to its last, so the prefill is not in it."""
    stamps: list[float] = []
    model.generate(prompt_ids, max_new_tokens=tokens, eos_token_id=[],
                   stream=lambda new: stamps.extend([time.perf_counter()] * len(new)))
    return (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def pass_cost(model, result, prompt_length: int) -> tuple[int, float | None]:
    """(the run's mean lookahead step size, what a pass of it costs in one-token passes by the model's cost model at
    the answer's middle; None without one). Size 2 where the run took no lookahead step."""
    sizes = [size for size in result.step_sizes if size > 1]
    size = round(sum(sizes) / len(sizes)) if sizes else 2
    cost = getattr(model, "cost_model", None)
    if cost is None or not cost.curves:
        return size, None
    length = prompt_length + len(result.tokens) // 2
    return size, cost.predict(size, length) / cost.predict(1, length)


def why_plain(model, result, prompt_length: int) -> str | None:
    """Where most steps of a self-tuned run were plain, why: what a lookahead step cost here in one-token steps (a
    busy or slow machine makes multi-token passes dear) and what the lookahead steps it did take gave (drafts that
    are seldom right do not pay). None where most steps were lookahead steps."""
    sizes, gained = result.step_sizes, result.step_tokens[1:]
    plain = sum(size == 1 for size in sizes)
    if not sizes or plain / len(sizes) <= MOSTLY_PLAIN:
        return None
    lookahead = [len(got) for size, got in zip(sizes, gained, strict=False) if size > 1]
    gave = sum(lookahead) / len(lookahead) if lookahead else None
    size, ratio = pass_cost(model, result, prompt_length)
    reasons = []
    if ratio is not None and ratio >= BUSY:
        reasons.append("multi-token steps are dear here (a busy or slow machine)")
    if gave is None or gave < WEAK:
        reasons.append("the drafts are not paying on this text")
    facts = []
    if ratio is not None:
        facts.append(f"a {size}-token step costs {ratio:.1f} one-token steps")
    if gave is not None:
        facts.append(f"lookahead steps gave {gave:.1f} tokens each")
    because = " and ".join(reasons) or "drafts worth less than their cost"
    return f"{plain} of {len(sizes)} steps fell back to plain because {because}" + (
        f" ({', '.join(facts)})" if facts else "")


def decoding_rate(result, stamps: list[float]) -> float | None:
    """Tokens per second from the answer's first token to its last (`stamps`: when each token arrived), as
    `probe_plain` times plain decoding: the prefill is in neither. None for an answer of one token."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def whole_answer_rate(decoding: float | None, tokens: int, first_token_seconds: float | None) -> float | None:
    """Tokens per second of a whole answer of `tokens` tokens whose first came after `first_token_seconds` (the
    prefill) and the rest at `decoding` tokens/s: a probe's plain rate (`probe_plain`, prefill excluded) as the summary
    line times an answer, prefill included, so the two sit side by side."""
    if decoding is None or first_token_seconds is None or tokens < 1:
        return decoding
    return tokens / (first_token_seconds + (tokens - 1) / decoding)


def why_slower(result, rate: float | None, plain_rate: float | None, why: str | None = None,
               passes: float | None = None) -> str | None:
    """Where lookahead decoded slower than plain decoding here (`rate` against `plain_rate`, tokens/s timed alike),
    by how much and why, plainly; None where it did not. Lookahead's rate is plain's times S over what a step took in
    plain steps, so it loses exactly where its steps took longer than the tokens they gave: because most steps fell
    back to plain (`why`, `why_plain`'s) and the loop's own work per step (drafting, checking) was not repaid, because
    the drafts were seldom right (lookahead steps gave fewer than `WEAK` tokens), because the loop's own work took
    most of each step (a step took `LOOP` times what its pass costs, `passes`: `pass_cost`'s, where known), or
    because multi-token passes are dear here (a busy or slow machine)."""
    decoded = result.step_tokens[1:]  # the prefill's step gives the first token only
    if rate is None or not plain_rate or rate >= plain_rate or not decoded:
        return None
    gave = sum(len(tokens) for tokens in decoded) / len(decoded)
    took = gave * plain_rate / rate  # a decoding step's time, in plain steps
    fact = f"a step gave {gave:.2f} tokens and took {took:.2f} plain steps' time"
    lookahead = [len(tokens) for tokens, size in zip(decoded, result.step_sizes, strict=False) if size > 1]
    if why is not None:
        cause = f"{why}; the loop's own work per step (drafting, checking) was not repaid ({fact})"
    elif lookahead and sum(lookahead) / len(lookahead) < WEAK:
        cause = f"the drafts were seldom right on this text ({fact})"
    elif passes is not None and took >= LOOP * max(passes, 1.0):
        cause = (f"the loop's own work per step (drafting, checking) took most of each step ({fact}, its pass "
                 f"{passes:.2f})")
    else:
        cause = f"multi-token passes are dear here, a busy or slow machine ({fact})"
    return f"lookahead was {rate / plain_rate:.2f}x plain here: {cause}"


def comparison(plain: Timed, ahead: Timed, exact: bool, why: str | None = None, passes: float | None = None) -> str:
    """`--compare`'s verdict: lookahead's tokens/s over plain decoding's, (greedy or seeded) whether the tokens are
    the same, and where lookahead was slower, why (`why_slower`, given `why_plain`'s `why` and `pass_cost`'s
    `passes`)."""
    plain_rate, rate = plain.rate, ahead.rate
    same = ""
    if exact:
        same = (", the same tokens" if plain.result.tokens == ahead.result.tokens
                else ", different tokens (16-bit near-ties)")
    line = f"lookahead / plain: {rate / plain_rate:.2f}x ({rate:.1f} against {plain_rate:.1f} tok/s{same})"
    slower = why_slower(ahead.result, rate, plain_rate, why, passes)
    return line if slower is None else f"{line}; {slower}"
