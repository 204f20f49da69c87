"""`Curve`: what one kind of forward pass costs on the machine it runs on, as a function of its tokens and its cache
length, first measured (`fit`) and then kept current by every step's own timing (`Curve.observe`).

A step that feeds T tokens (all rows of a batch together) over a cache of L positions costs

    t(T, L) = base(T) + per_position(T) * L    seconds,

both piecewise-linear in T between measured knots (1, 2, 4, ... and the largest step: `knots_up_to`; on CUDA the
captured buckets).

Where the figures come from:
- a first estimate from a few timed passes at two cache lengths (`fit`), taken at `warmup()` or before the first
  generation that needs it (`lookahead.models.tuning`);
- then every step's own timing (`observe`): the two knots around its T move a fraction of the way towards what it
  cost, so a machine that gets busier (multi-token steps suffer from contention more than one-token steps) is
  noticed within a few steps; the move is split between the base and the cost per position by the step's cache
  length, so a curve first measured at one length learns the cost per position from steps at others;
- figures that may be stale are not kept on trust. A knot no step has run lately (`STALE_AFTER` observations of the
  curve; never, for a curve just read or measured) is stale (`stale_knot`), and the budget explores it now and then; a
  stale knot's own step that ran faster than it says overwrites it (timing noise only adds time: a fast step is
  evidence, a slow one may be a pause, so that direction keeps the bounded move). A stale knot whose step confirmed
  it waits twice as long before it is stale again, so a size that is truly dear is re-run ever more rarely. And a
  plain step (no larger than the first knot: one token, or a batch's one a row) `SHIFT` times faster than the curve
  says means the curve was measured on a slower moment: the whole curve is scaled by what that step measured, and
  its other knots become stale.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

UPDATE_RATE = 0.3  # how far one observation moves its knots towards what it measured
MAX_RATIO = 2.0  # one observation moves a knot by at most this factor: a stray pause is not a new machine
MAX_KNOT = 1 << 20  # tokens of one step (all rows) a curve may be measured to: no step holds more
MIN_SECONDS = 1e-9  # the least a step may cost (a nanosecond): below it 1 / t overflows to inf, and no pass is faster
LENGTH_SCALE = 512  # cache positions at which an observation's move is split evenly between base and per-position
SPREAD = 0.5  # the share of a multi-token step's move that reaches the other multi-token knots (contention slows
# every multi-token size, if not alike), so sizes not run lately are not judged by stale figures; a one-token step
# moves its own knot only, as contention slows it less
STALE_AFTER = 32  # observations of a curve after which a knot no step has run since is stale (and may be explored)
MAX_STALE_AFTER = 1024  # a stale knot confirmed by its step waits twice as long before it is stale again, up to this
VECTOR_FROM = 48  # `predict_many` of at least this many sizes runs in numpy (fewer: a Python loop costs less)
SHIFT = 3.0  # a plain step this many times faster than predicted says the whole curve was measured on a slower moment


@dataclass
class Curve:
    """t(T, L) = base(T) + per_position(T) * L, linear in T between `knots` and beyond the last one."""

    knots: list[int]
    base: list[float]
    per_position: list[float]

    def __post_init__(self) -> None:
        for name in ("knots", "base", "per_position"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"Curve.{name} must be a list, got {type(values).__name__} {values!r:.80}")
            setattr(self, name, list(values))
        self.check()
        # what the steps of this process have run (not saved, not compared): observations so far, and per knot the
        # observation that last ran it (None: none yet, so a curve read from a file or just measured is stale) and
        # how many observations it stays trusted after that
        self.observed = 0
        self.ran: list[int | None] = [None] * len(self.knots)
        self.trusted_for = [STALE_AFTER] * len(self.knots)

    def check(self) -> None:
        """Refuse what no measurement gives (TypeError, ValueError naming the field and the value): knots that are not
        increasing ints in 1..`MAX_KNOT`, costs that are not finite numbers (a base of at least `MIN_SECONDS`, a cost
        per position >= 0), lists of different lengths."""
        for name, kinds in (("knots", int), ("base", (int, float)), ("per_position", (int, float))):
            for value in getattr(self, name):
                if isinstance(value, bool) or not isinstance(value, kinds):
                    what = "ints (token counts)" if name == "knots" else "numbers (seconds)"
                    raise TypeError(f"Curve.{name} must hold {what}, got {type(value).__name__} {value!r:.40} in "
                                    f"{self._shown(name)}")
        n = len(self.knots)
        if n == 0 or len(self.base) != n or len(self.per_position) != n:
            raise ValueError(f"a cost curve needs one base and one per-position cost per knot, got {n} knots, "
                             f"{len(self.base)} and {len(self.per_position)}")
        if (self.knots[0] < 1 or self.knots[-1] > MAX_KNOT
                or any(b <= a for a, b in zip(self.knots, self.knots[1:], strict=False))):
            raise ValueError(f"Curve.knots must be increasing token counts in 1..{MAX_KNOT}, "
                             f"got {self._shown('knots')}")
        if not all(math.isfinite(x) and x >= MIN_SECONDS for x in self.base):
            raise ValueError(f"Curve.base must hold finite costs of at least {MIN_SECONDS} s, "
                             f"got {self._shown('base')}")
        if not all(math.isfinite(x) and x >= 0 for x in self.per_position):
            raise ValueError(f"Curve.per_position must hold finite costs >= 0, got {self._shown('per_position')}")
        self._monotone()

    def _shown(self, name: str) -> str:
        text = repr(getattr(self, name))
        return text if len(text) <= 80 else text[:77] + "..."

    def _monotone(self) -> None:
        """A step of more tokens, or over a longer cache, never costs less: a curve that falls as T grows is noise (one
        slow pass at a small size, a quiet moment at a large one), not a machine. Both coefficient lists become their
        closest non-decreasing fit (pool-adjacent-violators, least squares), so the chooser is never lured into a
        larger step by a dip."""
        self.base[:] = nondecreasing(self.base)
        self.per_position[:] = nondecreasing(self.per_position)

    def _bracket(self, tokens: int) -> tuple[int, int, float]:
        """The knots i, j whose segment holds `tokens` (the last segment beyond the ends) and its weight on j."""
        knots = self.knots
        if len(knots) == 1:
            return 0, 0, 0.0
        j = 1
        while j < len(knots) - 1 and knots[j] < tokens:
            j += 1
        i = j - 1
        return i, j, (tokens - knots[i]) / (knots[j] - knots[i])

    def _own(self, tokens: int) -> int:
        """The knot a step of `tokens` tokens runs: the nearest (the lower of two as near)."""
        i, j, w = self._bracket(tokens)
        return j if w > 0.5 else i

    def _is_stale(self, k: int) -> bool:
        if len(self.ran) != len(self.knots):  # the knots were changed by hand: nothing about them is known
            self.ran, self.trusted_for = [None] * len(self.knots), [STALE_AFTER] * len(self.knots)
        return self.ran[k] is None or self.observed - self.ran[k] >= self.trusted_for[k]

    def stale_knot(self, tokens: int) -> int | None:
        """The stale knot a step of `tokens` tokens would run (its nearest), None where that knot is not stale: a
        knot is stale where no step has run it in its last `trusted_for` observations (or ever, since the curve was
        read or measured)."""
        own = self._own(tokens)
        return self.knots[own] if self._is_stale(own) else None

    def stale_knots(self, tokens: Sequence[int]) -> list[int | None]:
        """`stale_knot` of each of `tokens`, the bracket moving along sorted tokens."""
        knots = self.knots
        if len(knots) == 1:
            return [self.stale_knot(t) for t in tokens]
        stale = [knot if self._is_stale(k) else None for k, knot in enumerate(knots)]
        if stale.count(None) == len(stale):
            return [None] * len(tokens)
        if len(tokens) >= VECTOR_FROM:  # (the budget's exploration asks for every step size: numpy, as predict_many)
            at = np.asarray(tokens, dtype=np.int64)
            edges = np.asarray(knots, dtype=np.int64)
            j = np.clip(np.searchsorted(edges, at, side="left"), 1, len(knots) - 1)
            w = (at - edges[j - 1]) / (edges[j] - edges[j - 1])
            return [stale[k] for k in np.where(w > 0.5, j, j - 1).tolist()]
        return [stale[j] if w > 0.5 else stale[j - 1] for j, w in self._segments(tokens)]

    def _segments(self, tokens: Sequence[int]) -> Iterator[tuple[int, float]]:
        """(j, w) for each of `tokens` (two knots or more): the segment knots[j - 1]..knots[j] it falls in (the
        first or last one beyond the knots) and its place along it, as `_bracket` finds them, the bracket moving
        along sorted tokens."""
        knots, last, j = self.knots, len(self.knots) - 1, 1
        for t in tokens:
            if j > 1 and knots[j - 1] >= t:  # not sorted: find the segment afresh
                j = 1
            while j < last and knots[j] < t:
                j += 1
            yield j, (t - knots[j - 1]) / (knots[j] - knots[j - 1])

    def stale_at(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens would run a stale knot (`stale_knot`)."""
        return self.stale_knot(tokens) is not None

    def floor(self, tokens: int, length: int) -> float:
        """The least a step of `tokens` tokens may cost by the knots steps ran lately: the prediction at the largest
        such knot at or below it (a larger step never costs less); 0 where there is none."""
        fresh = [k for k, knot in enumerate(self.knots) if knot <= tokens and not self._is_stale(k)]
        return self.base[fresh[-1]] + self.per_position[fresh[-1]] * length if fresh else 0.0

    def predict(self, tokens: int, length: int) -> float:
        """Seconds of a step of `tokens` tokens over `length` cached positions."""
        i, j, w = self._bracket(tokens)
        at = [self.base[k] + self.per_position[k] * length for k in (i, j)]
        # extrapolation below the first knot stays positive
        return max(at[0] + w * (at[1] - at[0]), 0.25 * min(at), MIN_SECONDS)

    def predict_many(self, tokens: Sequence[int], length: int) -> list[float]:
        """`predict` of each of `tokens` (all over `length` cached positions), bit for bit, for the budget's scan of
        every step size: the knots' costs at `length` are computed once, and the bracket moves along sorted tokens."""
        knots, min_seconds = self.knots, MIN_SECONDS
        at = [b + p * length for b, p in zip(self.base, self.per_position, strict=True)]  # as predict adds them
        if len(tokens) >= VECTOR_FROM and len(knots) > 1:
            return self._predict_array(np.asarray(tokens, dtype=np.int64), np.asarray(at)).tolist()
        if len(knots) == 1:
            return [max(at[0] + 0.0 * (at[0] - at[0]), 0.25 * at[0], min_seconds) for _ in tokens]
        out = []
        for j, w in self._segments(tokens):
            a, b = at[j - 1], at[j]
            out.append(max(a + w * (b - a), 0.25 * (a if a <= b else b), min_seconds))
        return out

    def _predict_array(self, tokens: np.ndarray, at: np.ndarray) -> np.ndarray:
        """`predict_many` in numpy: the same float64 operations elementwise, so the same bits (each segment found by
        a search: the first knot at or above the tokens, between the second knot and the last)."""
        knots = np.asarray(self.knots, dtype=np.int64)
        j = np.clip(np.searchsorted(knots, tokens, side="left"), 1, len(knots) - 1)
        a, b = at[j - 1], at[j]
        w = (tokens - knots[j - 1]) / (knots[j] - knots[j - 1])
        return np.maximum(np.maximum(a + w * (b - a), 0.25 * np.minimum(a, b)), MIN_SECONDS)

    def observe(self, tokens: int, length: int, seconds: float) -> None:
        """Move the knots around `tokens` towards a step's measured `seconds`, each by its share of the step, and for
        a multi-token step the other multi-token knots by `SPREAD` of that.

        A knot's prediction at the step's cache length L moves `UPDATE_RATE` x its share of the way; the move is split
        between its base and its cost per position as a normalised least-mean-squares step on the features
        (1, L / LENGTH_SCALE) would split it: all to the base at L = 0, evenly at `LENGTH_SCALE`, mostly to the slope
        beyond. So steps at different lengths teach the cost per position, even where the first measurement had one
        length only (a transformers model, a small cache).

        Stale figures (see the module's docstring): where the step's nearest knot is stale and the step ran faster
        than predicted, that knot is overwritten with what the step took and stale knots below it are held to it;
        slower, it alone moves the bounded way (a stale figure's miss is its own, not news of the machine's load); a
        plain step `SHIFT` times faster than predicted rescales the curve."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        length = max(length, 0)
        measured = seconds / self.predict(tokens, length)
        own = self._own(tokens)
        stale = self._is_stale(own)
        self.observed += 1
        if tokens <= self.knots[0] and measured * SHIFT <= 1.0:  # the plain step (one token, or one a row)
            self._rescale(measured)
            return
        ratio = min(max(measured, 1 / MAX_RATIO), MAX_RATIO)
        i, j, w = self._bracket(tokens)
        w = min(max(w, 0.0), 1.0)
        if stale:  # a stale figure's miss is its own, not news of the machine's load: it alone moves
            shares = [1.0 if k == own else 0.0 for k in range(len(self.knots))]
        else:
            spread = SPREAD if tokens > 1 else 0.0
            shares = [spread if knot > 1 else 0.0 for knot in self.knots]
            shares[i], shares[j] = (1.0, 1.0) if i == j else (max(1.0 - w, shares[i]), max(w, shares[j]))
        # each knot's prediction at this length moves by its share of the step's (bounded) move
        changes = [(self.base[k] + self.per_position[k] * length) * UPDATE_RATE * share * (ratio - 1.0)
                   for k, share in enumerate(shares)]
        if stale and measured < 1.0:
            # a stale knot's own step that ran faster overwrites it (no pause makes a step fast) with what the step
            # took: exact for a step of the knot's size, near it for a step nearest to it
            changes[own] = seconds - (self.base[own] + self.per_position[own] * length)
        u = length / LENGTH_SCALE
        for k, change in enumerate(changes):
            target = self.base[k] + self.per_position[k] * length + change
            self.base[k] = max(self.base[k] + change / (1 + u * u), MIN_SECONDS)
            self.per_position[k] = max(self.per_position[k] + change * u / (LENGTH_SCALE * (1 + u * u)), 0.0)
            if k == own and stale and measured < 1.0:  # what the cost per position cannot give up, the base does
                self.base[k] = max(target - self.per_position[k] * length, MIN_SECONDS)
        if stale and measured < 1.0:  # a smaller step costs no more: stale knots below it are held to it
            for k in range(own):
                if self._is_stale(k):
                    self.base[k] = min(self.base[k], self.base[own])
                    self.per_position[k] = min(self.per_position[k], self.per_position[own])
        if stale:  # confirmed: trusted twice as long; found dear by a factor of 2: as long as at first
            confirmed = measured >= 1 / MAX_RATIO
            self.trusted_for[own] = min(2 * self.trusted_for[own], MAX_STALE_AFTER) if confirmed else STALE_AFTER
        self.ran[own] = self.observed
        self._monotone()

    def _rescale(self, factor: float) -> None:
        """The machine runs `factor` times the speed the curve was measured at (a plain step said so): every knot
        scaled by it, the smallest run now, the others stale (to be measured again)."""
        self.base[:] = [max(b * factor, MIN_SECONDS) for b in self.base]
        self.per_position[:] = [p * factor for p in self.per_position]
        self.ran = [self.observed] + [None] * (len(self.knots) - 1)
        self.trusted_for = [STALE_AFTER] * len(self.knots)

    def to_dict(self) -> dict:
        return {"knots": list(self.knots), "base": list(self.base), "per_position": list(self.per_position)}


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool-adjacent-violators)."""
    # most calls (every step's observation) find nothing to pool
    if all(a <= b for a, b in zip(values, values[1:], strict=False)):
        return list(values)
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def fit(samples: Iterable[tuple[int, int, float]]) -> Curve:
    """A curve through timed steps (tokens, cache length, seconds): at each token count, the median at the shortest
    and at the longest length measured give the base and the cost per cached position (0 where one length only, or
    where noise makes it negative); one stray pass among the repeats does not move it. The curve is then made
    non-decreasing in T (`Curve`)."""
    grouped: dict[int, dict[int, list[float]]] = {}
    for tokens, length, seconds in samples:
        grouped.setdefault(tokens, {}).setdefault(length, []).append(seconds)
    if not grouped:
        raise ValueError("fit needs at least one timed step")
    knots, base, per_position = sorted(grouped), [], []
    for tokens in knots:
        by_length = grouped[tokens]
        short, long = min(by_length), max(by_length)
        at_short, at_long = (statistics.median(by_length[x]) for x in (short, long))
        slope = max((at_long - at_short) / (long - short), 0.0) if long > short else 0.0
        base.append(max(at_short - slope * short, 1e-3 * at_short, MIN_SECONDS))
        per_position.append(slope)
    return Curve(knots, base, per_position)


def knots_up_to(largest: int, sizes: Sequence[int] = ()) -> list[int]:
    """The token counts to time for steps of up to `largest` tokens: 1, 2, 4, ... below it, `largest` itself, and
    any `sizes` (the captured buckets on CUDA)."""
    knots = {1, largest, *sizes}
    power = 2
    while power < largest:
        knots.add(power)
        power *= 2
    return sorted(k for k in knots if 1 <= k <= largest)
