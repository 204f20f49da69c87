"""`StepBudget`: how much of its draft each step of one generation verifies, by what it is worth on this machine.

Before a step runs, the draft tree knows what each node is worth: grown best first, node i's score is the chance
that the step accepts it (`lookahead.drafts.edges`), so a step verifying the first n nodes expects
E(n) = 1 + c * (score_0 + ... + score_{n-1}) tokens (the 1: the model's own next token, which every step gives).
The cost model knows what a step of T tokens costs here, t(T, L). A step takes the n that maximises E / (t + h)
(h: the loop's own time per step, measured), or a plain one-token step when nothing beats plain decoding's
1 / (t(1) + h). Everything it reads is known before the step, so the
tokens are the same whatever it picks (greedy: plain greedy's; sampling: keyed by position).

It keeps itself honest with what the steps then did:
- c, the draft scores' calibration: accepted nodes over expected ones so far, per band of the expected sum (the
  edge model was fitted on one model and one prompt set, and its sums are too flat: small sums come out low and
  large ones high, so one factor for all would misjudge both ends; another model or text drafts better or worse);
- the cost model learns each step's measured time (`CostModel.observe`), so a machine that gets busier steps
  smaller, and h follows the loop's time outside the model;
- after `PROBE_AFTER` plain steps in a row it runs its best lookahead step once, so multi-token costs learned on a
  busy machine are measured again when the machine quietens.

The lookahead branch (W(N - 1) tokens of Jacobi iterations) is worth nothing in its own step: its n-grams pay
later, through the pool. On a CPU (steps of any size) a self-tuned step runs without it: the input token and the
first n nodes, so the cheapest lookahead step is 2 tokens, not W(N - 1) + 1 (`BRANCH`; measured against steps that
carry it: docs/results.md, "Self-tuned steps"). On CUDA with static steps the sizes come from a few buckets
(`buckets`), each one shape captured as a CUDA graph at warm-up, which carries the branch (a pass of a few more
tokens costs a GPU about nothing) and verifies as many nodes as fit.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lookahead.config import LookaheadConfig

from .cost import CostModel

BUCKET_SIZES = (8, 16, 32, 64, 128, 256, 512)  # tokens per row of the static shapes between plain and full
BRANCH_POLICIES = ("always", "never")  # steps of any size (CPU) run the lookahead branch always, or never
BRANCH = "never"
PROBE_AFTER = 8  # plain steps in a row after which one lookahead step measures multi-token costs again
CALIBRATION_BANDS = (0.25, 0.5, 1.0, 2.0, 4.0)  # bounds of the bands of a row's expected nodes, calibrated apart
CALIBRATION_PRIOR = 2.0  # expected nodes of evidence each band's calibration starts from (c = 1)
HOST_RATE = 0.2  # how fast the loop's own time per step follows its measurements


@dataclass(frozen=True)
class Choice:
    """A step's size: `nodes` draft nodes verified per row (at most; a row may have fewer), `branch` whether the
    lookahead branch runs, `slots` node places per row in the step's shape (padding included: a bucket's), and
    `tokens` fed per row. `expected` tokens and `seconds` are what the budget predicted (None: a fixed step)."""

    nodes: int
    branch: bool
    slots: int
    tokens: int
    expected: float | None = None
    seconds: float | None = None

    @property
    def plain(self) -> bool:
        """One token: no branch, no draft."""
        return not self.branch and not self.nodes


def buckets(cfg: LookaheadConfig) -> list[int]:
    """Tokens per row of the static step shapes a self-tuned generation may use: 1 (plain), the `BUCKET_SIZES` that
    hold the lookahead branch and at least one node, and the full step."""
    branch, full = cfg.window * (cfg.ngram - 1), cfg.step_tokens
    return [1, *(b for b in BUCKET_SIZES if branch < b < full), *([full] if full > 1 else [])]


def bucket_choices(cfg: LookaheadConfig) -> list[Choice]:
    """The static shapes of `buckets`, as choices of their full node slots."""
    branch = cfg.window * (cfg.ngram - 1)
    return [Choice(0, False, 0, 1) if size == 1 else Choice(size - branch, True, size - branch, size)
            for size in buckets(cfg)]


class StepBudget:
    """The per-step size chooser of one generation (one prompt, or a batch stepping together).

    cost: the machine's `CostModel` (it is updated in place). kind: its curve ("greedy", "sampling"). static: step
    sizes from `buckets` (CUDA graphs) rather than any size. clock: seconds, for the loop's timings (tests give a
    fake one)."""

    def __init__(self, cfg: LookaheadConfig, cost: CostModel, kind: str = "greedy", static: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg, self.cost, self.kind, self.clock = cfg, cost, kind, clock
        self.sizes = bucket_choices(cfg)[1:] if static else None  # the lookahead shapes, smallest first
        self.expected = [0.0] * (len(CALIBRATION_BANDS) + 1)  # per band: nodes the scores expected, and accepted
        self.accepted = [0.0] * (len(CALIBRATION_BANDS) + 1)
        self.host = 0.0  # seconds per step the loop spends outside the model
        self.plain_run = 0  # plain steps in a row
        self.last = clock()  # when the last step was recorded: a step's loop time runs from there

    def calibrated(self, expected: float) -> float:
        """A row's expected accepted nodes by its draft scores, times c of its band: the nodes accepted per node
        expected, so far in this generation, by steps whose rows expected about as many."""
        band = bisect.bisect_right(CALIBRATION_BANDS, expected)
        return expected * (self.accepted[band] + CALIBRATION_PRIOR) / (self.expected[band] + CALIBRATION_PRIOR)

    def choose(self, scores: Sequence[Sequence[float]], branch: int, length: int) -> Choice:
        """The size of the next step. scores: each row's draft node scores, best first (a prefix of a best-first
        tree is a tree); branch: the lookahead branch's tokens per row (W times the window's levels); length: the
        cache length L (a batch: its longest row)."""
        rows = len(scores)
        prefix = []  # per row, the expected accepted nodes of its first n nodes, n = 0, 1, ...
        for row in scores:
            sums, total = [0.0], 0.0
            for score in row:
                total += score
                sums.append(total)
            prefix.append(sums)
        longest = max(map(len, scores), default=0)
        plain = Choice(0, False, 0, 1, float(rows), self._seconds(rows, length))
        best, best_rate, best_lookahead = plain, rows / plain.seconds, None
        candidates = self.sizes or [Choice(n, BRANCH == "always", n, (branch if BRANCH == "always" else 1) + n)
                                    for n in range(1, longest + 1)]
        for size in candidates:
            nodes = min(size.slots, longest)
            if nodes == 0:
                continue
            expected = rows + sum(self.calibrated(sums[min(nodes, len(sums) - 1)]) for sums in prefix)
            seconds = self._seconds(rows * size.tokens, length)
            choice = Choice(nodes, size.branch, size.slots, size.tokens, expected, seconds)
            if best_lookahead is None or expected / seconds > best_lookahead.expected / best_lookahead.seconds:
                best_lookahead = choice
        if best_lookahead is not None and (best_lookahead.expected / best_lookahead.seconds > best_rate
                                           or self.plain_run >= PROBE_AFTER):
            best = best_lookahead
        self.plain_run = self.plain_run + 1 if best.plain else 0
        return best

    def _seconds(self, tokens: int, length: int) -> float:
        return self.cost.predict(tokens, length, self.kind) + self.host

    def record(self, choice: Choice, tokens: int, length: int, step_seconds: float, expected_nodes: float,
               accepted_nodes: int, rows: int = 1) -> None:
        """What a step did: it fed `tokens` tokens (all `rows` rows) at cache length `length`, the model took
        `step_seconds` (the rest of the time since the last record is the loop's own), and its rows accepted
        `accepted_nodes` draft nodes where their scores expected `expected_nodes` (uncalibrated)."""
        now = self.clock()
        self.cost.observe(tokens, length, step_seconds, self.kind)
        self.host += HOST_RATE * (max(now - self.last - step_seconds, 0.0) - self.host)
        self.last = now
        if not choice.plain:
            band = bisect.bisect_right(CALIBRATION_BANDS, expected_nodes / rows)
            self.expected[band] += expected_nodes
            self.accepted[band] += accepted_nodes
