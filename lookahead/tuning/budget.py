"""`StepBudget`: how much of its draft each row of a packed step verifies, by what it is worth on this machine, for the
whole step at once.

Before a step runs, each row's draft tree knows what each node is worth: grown best first, node i's score is the
chance that the step accepts it (`lookahead.drafts.edges`), so a row verifying its first n nodes expects
E(n) = 1 + c * (score_0 + ... + score_{n-1}) tokens (the 1: the model's own next token, which every step gives).
The cost model knows what a step of T tokens over cache length L costs here, t(T, L) (all rows together: T the
step's tokens, L their mean cache length). The step takes (row, node) slots in decreasing calibrated worth, a row's
node only after its parent, and keeps the count of slots that maximises the step's expected tokens per second,
sum E / (t + h) (h: the loop's own time per step, measured); where no count beats every row decoding plainly, the
step is plain. So a row whose draft is worth six tokens takes thirty nodes while another takes none, and a batch
never pays for drafts that do not pay: on a busy machine or a large batch the slots stop paying sooner. Everything
it reads is known before the step, so the tokens are the same whatever it picks (greedy: plain greedy's; sampling:
keyed by position).

It keeps itself honest with what the steps then did:
- c, the draft scores' calibration: accepted nodes over expected ones so far, per band of a row's expected sum (the
  edge model was fitted on one model and one prompt set, and its sums are too flat: small sums come out low and
  large ones high, so one factor for all would misjudge both ends; another model or text drafts better or worse);
- the cost model learns each step's measured time (`CostModel.observe`), so a machine that gets busier steps
  smaller, and h follows the loop's own time in each step it sized (planning, drafting, verifying, sending: given
  by the engine, which times them; never the time between steps, an idle server's wait or a step of prompts alone,
  nor a new request's setup, which would make h seconds long and every step look cheap beside it, so the budget took
  the largest);
- it explores: at most one step in `EXPLORE_EVERY` runs a size whose knot no step ran lately (`CostModel.stale_knot`:
  the knot's own size where the draft reaches it, else the fullest step nearest to it), the smallest such that could
  beat the step it would otherwise take were it as cheap as the knots run lately allow (`CostModel.floor`), so costs
  measured on a busy moment (a file, a first measurement, a burst of contention) are measured again once the
  machine quietens, and a size that is truly dear is re-run ever more rarely (the cost model trusts a confirmed knot
  twice as long each time).

The lookahead branch (W(N - 1) tokens of Jacobi iterations) is worth nothing in its own step: its n-grams pay
later, through the pool. On a CPU (steps of any size) a lookahead row runs without it: the input token and its n
nodes, so the cheapest lookahead row is 2 tokens, not W(N - 1) + 1 (`BRANCH`; measured against steps that carry it:
docs/results.md, "Self-tuned steps"). With static steps (CUDA graphs) the step's tokens are rounded up to a captured
size, and every lookahead row carries the branch (a few more tokens cost a GPU about nothing).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import lookahead.host_loops as host_loops
from lookahead.config import LookaheadConfig

from .cost import CostModel

BUCKET_SIZES = (8, 16, 32, 64, 128, 256, 512)  # tokens per row of the static shapes between plain and full
BRANCH_POLICIES = ("always", "never")  # steps of any size (CPU) run the lookahead branch always, or never
BRANCH = "never"
EXPLORE_EVERY = 8  # steps at least between two that run a size only to measure it again (a stale knot)
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


@dataclass(frozen=True)
class Fixed:
    """The part of a step the budget does not size: rows that decode plainly (a request without lookahead) and prompt
    chunks. `tokens` they feed, `expected` tokens they give (a plain row 1; the scheduler counts a chunk none, though
    a prompt's last gives its first token: a constant beside every option, which changes no choice), `weight`: the sum
    of their tokens' cache lengths (what their attention reads)."""

    tokens: int = 0
    expected: float = 0.0
    weight: int = 0


NOTHING_FIXED = Fixed()  # a step of lookahead rows only


class Rated(NamedTuple):
    """A step's expected tokens and predicted seconds (the loop's own time included)."""

    expected: float
    seconds: float


class StepBudget:
    """The per-step size chooser of the rows an engine steps together: how many draft nodes each lookahead row
    verifies in the next packed step (a row may take none: a plain one-token row, while another takes thirty).

    cost: the machine's `CostModel` (it is updated in place). kind: its curve ("greedy", "sampling"). static: steps
    are rounded up to captured shapes (CUDA graphs): every lookahead row carries its lookahead branch (a few more
    tokens cost a GPU about nothing), and a step's cost is that of `round_up(tokens)` tokens."""

    compiled = True  # merge the rows' slots with the compiled loop where it builds (`host_loops`); False: Python's

    def __init__(self, cfg: LookaheadConfig, cost: CostModel, kind: str = "greedy", static: bool = False,
                 round_up: Callable[[int], int] | None = None) -> None:
        self.cfg, self.cost, self.kind = cfg, cost, kind
        self.static, self.round_up = static, round_up or (lambda tokens: tokens)
        self.branch = static or BRANCH == "always"  # whether lookahead rows carry the lookahead branch
        self.expected = [0.0] * (len(CALIBRATION_BANDS) + 1)  # per band: nodes the scores expected, and accepted
        self.accepted = [0.0] * (len(CALIBRATION_BANDS) + 1)
        self.host = 0.0  # seconds per step the loop spends outside the model
        self.since_explored = 0  # steps since the last one that explored a stale knot
        self.explored = 0  # steps that did
        self._rounded: list[int] = []  # round_up(t) for t = 0, 1, ... as far as asked

    def calibrated(self, expected: float) -> float:
        """A row's expected accepted nodes by its draft scores, times c of its band: the nodes accepted per node
        expected, so far, by rows that expected about as many."""
        band = bisect.bisect_right(CALIBRATION_BANDS, expected)
        return expected * (self.accepted[band] + CALIBRATION_PRIOR) / (self.expected[band] + CALIBRATION_PRIOR)

    def choose(self, scores: Sequence[Sequence[float]], branch: int | Sequence[int], lengths: Sequence[int],
               fixed: Fixed = NOTHING_FIXED, steady: Fixed | None = None) -> list[Choice]:
        """Each lookahead row's size for the next step. scores: each row's draft node scores, best first (a prefix
        of a best-first tree is a tree); branch: the lookahead branch's tokens per row (W times the window's levels;
        carried only when `self.branch`), one for all rows or each row's own; lengths: each row's cache length L; fixed:
        the rest of the step; steady: that rest without its prompt chunks, where it holds some.

        The step takes (row, node) slots in decreasing calibrated worth (a row's node only after its parent, so each
        row's share is a prefix of its draft), and of every count of slots keeps the one that maximises the whole
        step's expected tokens per second, (expected tokens) / (t(tokens, L) + h), against every lookahead row
        decoding plainly. At most one step in `EXPLORE_EVERY` explores (`_explore`).

        A step that carries prompt chunks is dear, so its own rate is low and nearly any node would raise it; but a
        node's time could have decoded at the rows' steady rate R instead (the best rate of the step without the
        chunks). So such a step keeps the count that maximises expected tokens - R * seconds (which, for a step
        without chunks, is the count of the best rate itself), and does not explore."""
        rows = len(scores)
        branches = [branch] * rows if isinstance(branch, int) else list(branch)
        carries = branches if self.branch else [1] * rows  # each row's tokens before its nodes
        order, gains = self._slots(scores)
        # option k: the step with the first k slots (k = 0, every row's base alone, only where rows carry the branch)
        first = 0 if self.branch else 1
        plain, expected, seconds, rounded, length = self._options(fixed, carries, lengths, gains, first)
        rates = expected / seconds  # (numpy, elementwise: the same divisions as a scan's; argmax keeps the first best)
        best_rate, best_count = (plain.expected / plain.seconds, plain.seconds), None
        self.since_explored += 1
        if steady is not None:
            alone, alone_expected, alone_seconds, _, _ = self._options(steady, carries, lengths, gains, first)
            target = max([alone.expected / alone.seconds, *(alone_expected / alone_seconds).tolist()])
            profits = expected - target * seconds
            if len(profits):
                k = int(profits.argmax())
                if profits[k] > plain.expected - target * plain.seconds:
                    best_rate, best_count = (float(rates[k]), float(seconds[k])), k + first
        else:
            if len(rates):
                k = int(rates.argmax())  # the first of the best, as a scan keeps it
                if rates[k] > best_rate[0]:
                    best_rate, best_count = (float(rates[k]), float(seconds[k])), k + first
            if self.since_explored >= EXPLORE_EVERY:
                k = self._explore(rounded, expected, length, plain.seconds - self.host, best_rate[0])
                if k is not None and k + first != best_count:
                    best_rate, best_count = (float(rates[k]), float(seconds[k])), k + first
                    self.since_explored, self.explored = 0, self.explored + 1
        if best_count is None:
            return [Choice(0, False, 0, 1, 1.0, best_rate[1]) for _ in scores]
        best_taken = [0] * rows
        for r in order[:best_count]:
            best_taken[r] += 1
        return [Choice(n, self.branch, n, carry + n, 1 + self.calibrated(sum(row[:n])), best_rate[1])
                for n, row, carry in zip(best_taken, scores, carries, strict=True)]

    def _options(self, fixed: Fixed, carries: Sequence[int], lengths: Sequence[int], gains: Sequence[float],
                 first: int) -> tuple[Rated, np.ndarray, np.ndarray, list[int], int]:
        """The step of `fixed` and these rows, rated: with every row plain; then the expected tokens, seconds and
        (rounded-up) tokens of option k = first .. len(gains), the step with its first k slots (all rated at once by
        `predict_many`, the running sums in the order a slot-by-slot scan adds them: numpy's cumulative sum adds in
        order, so its float64 bits are the scan's; expected and seconds as float64 arrays); and the step's mean cache
        length, with every row at its base size (what each added slot's attention reads on average: a slot of a
        longer row reads more, a second-order effect the choice ignores)."""
        rows = len(carries)
        base_tokens, base_expected = fixed.tokens + sum(carries), fixed.expected + rows
        length = (fixed.weight + sum(n * c for n, c in zip(lengths, carries, strict=True))) // max(base_tokens, 1)
        plain_seconds = self.cost.predict(self.round_up(fixed.tokens + rows), length, self.kind) + self.host
        expected = np.cumsum([base_expected, *gains], dtype=np.float64)[first:]
        tokens = range(base_tokens + first, base_tokens + len(gains) + 1)
        rounded = self._rounded_upto(tokens.stop)[tokens.start : tokens.stop]
        seconds = np.asarray(self.cost.predict_many(rounded, length, self.kind), dtype=np.float64) + self.host
        return Rated(fixed.expected + rows, plain_seconds), expected, seconds, rounded, length

    def _rounded_upto(self, stop: int) -> list[int]:
        """`round_up(t)` for t = 0 .. stop - 1, remembered (a scan asks for every size each step)."""
        table = self._rounded
        if len(table) < stop:
            table += [self.round_up(t) for t in range(len(table), stop)]
        return table

    def _explore(self, sizes: Sequence[int], expected: Sequence[float], length: int, plain_seconds: float,
                 best: float) -> int | None:
        """The option (an index into `sizes`, each option's step rounded up, and `expected`) to run instead of the
        best one, to measure a stale knot again: the smallest whose step would run a knot no step ran lately and that
        would beat the best rate were it only as dear as the knots run lately allow (a larger step never costs less
        than a smaller one, nor than the plain step). None where there is none: a size known to be dear, or one that
        could not win, is not worth a step."""
        knots = self.cost.stale_knots(sizes, self.kind)
        if knots.count(None) == len(knots):  # (most steps: every knot ran lately; a scan of the sizes costs more)
            return None
        runs: dict[int, int] = {}  # per stale knot (smallest first): the option of its size, else the fullest
        for k, (size, knot) in enumerate(zip(sizes, knots, strict=True)):
            if knot is not None and (knot not in runs or size == knot or sizes[runs[knot]] != knot):
                runs[knot] = k  # options come in growing size: the last kept is the fullest
        for k in runs.values():
            least = max(self.cost.floor(sizes[k], length, self.kind), plain_seconds) + self.host
            if expected[k] / least > best:
                return k
        return None

    def _slots(self, scores: Sequence[Sequence[float]]) -> tuple[list[int], list[float]]:
        """`merge_slots` of every row's `_worths`: by the compiled loop where it builds (every node of every row, each
        step), else in Python (compiled=False: that one, for tests); the same numbers either way."""
        calibration = self._calibration()
        module = host_loops.load() if self.compiled else None
        if module is None:
            return merge_slots([self._worths(row, calibration) for row in scores])
        return module.slots(scores, CALIBRATION_BANDS, *calibration)

    def _calibration(self) -> tuple[list[float], list[float]]:
        """Each band's numerator and denominator of c, as `calibrated` computes them."""
        return ([a + CALIBRATION_PRIOR for a in self.accepted], [e + CALIBRATION_PRIOR for e in self.expected])

    def _worths(self, scores: Sequence[float], calibration: tuple[list[float], list[float]]) -> list[float]:
        """The calibrated expected nodes each further node of a row's draft adds (`calibrated` inline: this runs for
        every node of every row each step)."""
        worths, total, before = [], 0.0, 0.0
        numerator, denominator = calibration
        bands, band_of = CALIBRATION_BANDS, bisect.bisect_right
        for score in scores:
            total += score
            band = band_of(bands, total)
            now = total * numerator[band] / denominator[band]
            worths.append(now - before)
            before = now
        return worths

    def record_cost(self, tokens: int, length: int, step_seconds: float, loop_seconds: float = 0.0,
                    observe: bool = True) -> None:
        """What a step cost: it fed `tokens` tokens (every row) whose mean cache length was `length`, the model took
        `step_seconds`, the loop's own work for it (planning, drafting, verifying, sending) `loop_seconds`. observe:
        the cost model learns the step's time (False: another budget of the step taught it already)."""
        if observe:
            self.cost.observe(self.round_up(tokens), length, step_seconds, self.kind)
        self.host += HOST_RATE * (max(loop_seconds, 0.0) - self.host)

    def record_drafts(self, expected: Sequence[float], accepted: Sequence[int]) -> None:
        """What a step's drafts gave: each lookahead row that verified nodes accepted `accepted[i]` of them where its
        scores expected `expected[i]` (uncalibrated)."""
        for promised, got in zip(expected, accepted, strict=True):
            band = bisect.bisect_right(CALIBRATION_BANDS, promised)
            self.expected[band] += promised
            self.accepted[band] += got


def merge_slots(worths: Sequence[Sequence[float]]) -> tuple[list[int], list[float]]:
    """Every row's nodes in the order the budget takes them -- always the most worth among the rows' next nodes (a
    row's node only after its parent; ties to the lower row) -- as (each slot's row, its worth).

    What a heap of each row's next node, keyed (-worth, row), pops, without the heap: once a row's node is taken, its
    next nodes worth at least as much go straight after it (each beats every other row's head, as the taken one
    did), so each row splits into runs that start at a node and hold the nodes after it worth at least that much;
    a row's runs start ever lower, so the runs, sorted by (-first worth, row), are the pop order."""
    runs = []
    for r, row in enumerate(worths):
        start, n = 0, len(row)
        while start < n:
            head, end = row[start], start + 1
            while end < n and row[end] >= head:
                end += 1
            runs.append((-head, r, start, end))
            start = end
    runs.sort()
    order: list[int] = []
    gains: list[float] = []
    for _, r, start, end in runs:
        order += [r] * (end - start)
        gains += worths[r][start:end]
    return order, gains
