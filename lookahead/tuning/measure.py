"""Self-tuning on a model, one home for every model adapter (the native runner's `lookahead.models.tuning`, the
transformers adapter's `lookahead.hf.tuning`): which curve a request needs (`cost_model_for`), how steps are timed
into one (`time_steps`), and the cache key's parts that do not describe the model (`cost_key`). An adapter says only
how to run one pass of a step on its model and what describes its model.

What a request needs: with `LookaheadConfig(budget="auto")` and the tree form, a curve of its kind of step ("greedy"
or "sampling") up to its largest step, all rows together. A cost model the user set (an empty key) is used as it is;
otherwise the model's own, else the cached file's, measured now for what it lacks (`prepared`).

How it is measured: one untimed pass per step size (it prepares the shape: a kernel compile, a graph capture), then
a timed pass of each at cache length 0 and one at a longer length (the cost per cached position), then up to
`REPEATS - 1` more at length 0 while `MEASURE_BUDGET_S` lasts (a first start on a slow CPU took a minute before the
bound), fitted by `curve.fit` (medians, made monotone); the steps keep the curve current after. The longer length is
what the adapter can hold (`MIN_SPAN` at least, else the cost per position is left to the steps to learn:
`Curve.observe`). Each round is logged (`lookahead.tuning`, INFO: the command shows it as a progress line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lookahead.config import LookaheadConfig

from .cost import CostModel
from .curve import Curve, fit
from .store import Saver, device_label, load_or_new, versions

REPEATS = 3  # timed passes per step size at the shortest cache length (one at the longest): a median
MIN_SPAN = 256  # cache positions between the two lengths timed; below it the cost per position is not measured
MAX_SPAN = 2048  # the longer cache length timed, at most
MEASURE_BUDGET_S = 10.0  # past it, no more repeats: the first timed pass at each length is all the fit gets

log = logging.getLogger("lookahead.tuning")


def self_tuned(cfg: LookaheadConfig | None) -> bool:
    """Whether a request with this configuration sizes its steps by a cost model."""
    return cfg is not None and cfg.budget == "auto" and cfg.form == "tree"


@dataclass(frozen=True)
class Wanted:
    """The curve a self-tuned request's steps are sized by: of its kind of step (greedy or sampled) up to steps of
    `tokens` tokens, all rows together."""

    greedy: bool
    tokens: int

    @property
    def kind(self) -> str:
        return "greedy" if self.greedy else "sampling"


@dataclass(frozen=True)
class Source:
    """How an adapter gets the curve its model lacks: the cache file's key (`key()`, what describes the model and the
    machine) and a measurement on the model (`measure()`); each called only where it is needed."""

    key: Callable[[], Mapping]
    measure: Callable[[], Curve]


def cost_model_for(current: CostModel | None, cfg: LookaheadConfig | None, wanted: Wanted, source: Source,
                   saver: Saver) -> CostModel | None:
    """The cost model a request sizes its steps by: None for plain decoding or full-size steps; `current` if the user
    set it (its key is empty); else `prepared`'s."""
    if not self_tuned(cfg):
        return None
    if current is not None and not current.key:
        return current
    return prepared(current, wanted, source, saver)


def prepared(cost: CostModel | None, wanted: Wanted, source: Source, saver: Saver) -> CostModel:
    """The cost model for `source.key()` with the `wanted` curve: `cost` if it was measured for that key, else the one
    cached for it (or a new one); a missing curve or range is measured by `source.measure()` now and the model
    saved."""
    key = source.key()
    if cost is None or cost.key != dict(key):
        cost = load_or_new(key)
    if not cost.covers(wanted.kind, wanted.tokens):
        cost.extend(wanted.kind, source.measure())
        saver.now(cost)
    return cost


@dataclass(frozen=True)
class Passes:
    """The passes `time_steps` times: a step of `sizes[i]` tokens per row for each i, over `rows` rows, at cache
    length 0 and at `longest` (if at least `MIN_SPAN`); `quick` (under Triton's interpreter, where timings mean
    nothing): one timed pass at length 0."""

    sizes: Sequence[int]
    rows: int
    longest: int
    quick: bool


def time_steps(run: Callable[[int, int], None], passes: Passes, clock: Callable[[], float] = time.perf_counter,
               budget_s: float = MEASURE_BUDGET_S) -> Curve:
    """A curve from timed passes: `run(i, length)` runs one pass of step `i` at cache length `length` and returns when
    the device is done. Every step once untimed at length 0, then a timed pass of each at length 0 and at the longer
    length, then `REPEATS - 1` more at length 0 unless `budget_s` seconds have passed since the start (`Passes`). Logs
    a line per round (the command's progress)."""
    sizes, rows, longest, quick = passes.sizes, passes.rows, passes.longest, passes.quick
    far = [longest] if longest >= MIN_SPAN and not quick else []
    lengths = [0, *far, *([0] * (0 if quick else REPEATS - 1))]
    rounds, started = 1 + len(lengths), clock()
    log.info("measuring what a step costs on this machine (once: it is cached), up to %.0f s: round 1 of %d",
             budget_s, rounds)
    for i in range(len(sizes)):
        run(i, 0)  # prepares the shape
    samples = []
    for done, length in enumerate(lengths, 2):  # length by length: an adapter fills its cache to a length once a round
        if done > 2 + len(far) and clock() - started > budget_s:
            log.info("measuring: %.0f s spent; the rest is learned from the steps", clock() - started)
            break
        log.info("measuring: round %d of %d", done, rounds)
        for i, size in enumerate(sizes):
            start = clock()
            run(i, length)
            samples.append((rows * size, length, clock() - start))
    return fit(samples)


def cost_key(device, dtype, backend: str, model: list, interpreted: bool, packages: Sequence[str] = (),
             **more) -> dict:
    """What a step's cost depends on beyond the step, the cache file's key: the device (its GPU or CPU name), the
    dtype, the attention backend, what describes the model (`model`), the thread count, whether Triton is
    interpreted, the versions of torch, Triton, this package and `packages`, and the adapter's `more`."""
    import torch

    return {"device": device_label(device), "dtype": str(dtype), "backend": backend, **more,
            "threads": torch.get_num_threads(), "interpreted": interpreted, "model": list(model),
            "versions": [torch.__version__, *versions("triton", "lookahead", *packages)]}
