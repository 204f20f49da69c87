"""A model's cost model (`Llama.cost_model`): read from the disk cache, or measured on the model's own runner, before
the first self-tuned generation that needs it; saved back as the steps keep it current.

The figures depend on the device, the model's shape, dtype, attention backend and fusion, the thread count, CUDA
graphs and the versions of torch, Triton and this package: that is the cache file's key (its name is a digest of it),
so another machine, model or setting measures anew, and a file whose key or figures do not match is measured again.
A cost model set by the user (`model.cost_model = CostModel(...)`, with an empty key) is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from functools import cache
from importlib import metadata
from pathlib import Path

import torch

from lookahead.kernels import StepPattern, interpreting
from lookahead.loop import PLAIN_STEP, static_steps
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request
from lookahead.tuning import CostModel, Curve, buckets, fit, knots_up_to

from .default_model import default_cache_dir
from .runner import CachedRunner

REPEATS = 2  # timed passes per step size at the shortest cache length (one at the longest)
MIN_SPAN = 256  # cache positions between the two lengths timed; below it the cost per position is not measured
SAVE_EVERY = 60.0  # seconds between writes of the curves the steps keep current


def cost_model_for(model, runner: CachedRunner, request: Request) -> CostModel | None:
    """The cost model a self-tuned request sizes its steps by (None for plain decoding or full-size steps), measuring
    what the model's cost model lacks for it: a curve of this kind of step up to the request's largest step."""
    cfg = request.lookahead
    if cfg is None or cfg.budget != "auto" or cfg.form != "tree":
        return None
    cost = model.cost_model
    if cost is not None and not cost.key:
        return cost  # the user's
    key = cost_key(model, runner)
    if cost is None or cost.key != key:
        cost = CostModel.load(cost_path(key), key) or CostModel(key=key)
    kind = "greedy" if request.sampling.greedy else "sampling"
    sizes = buckets(cfg) if request.static_step else knots_up_to(cfg.step_tokens)
    batch = len(request.prompts)
    if not cost.covers(kind, batch * sizes[-1]):
        measured = measure(runner, request, sizes)
        cost.curves[kind] = measured if kind not in cost.curves else merged(cost.curves[kind], measured)
        cost.save(cost_path(key))
        model.cost_saved = time.monotonic()
    model.cost_model = cost
    return cost


def save_if_due(model) -> None:
    """Write the model's measured cost model back to its cache file, at most every `SAVE_EVERY` seconds: the next
    process starts from the curves as this one's steps left them."""
    cost = model.cost_model
    if cost is not None and cost.key and time.monotonic() - model.cost_saved >= SAVE_EVERY:
        cost.save(cost_path(cost.key))
        model.cost_saved = time.monotonic()


def measure(runner: CachedRunner, request: Request, sizes: list[int]) -> Curve:
    """Time steps of `sizes` tokens per row (the request's batch, its top-k and sampling) on the runner, at two
    cache lengths, and fit a curve in tokens per step (all rows). Static steps time the shapes the generation will
    run (each bucket's, captured on CUDA); otherwise a tree of each size. The runner must be freshly reset: the
    passes write placeholder entries and commit nothing."""
    cfg, batch = request.lookahead, len(request.prompts)
    sample = None if request.sampling.greedy else request.sampling
    if request.static_step:
        shapes = static_steps(cfg)
    else:
        topk = static_steps(cfg)[-1][2]
        shapes = [(_chain(size), size, topk) for size in sizes]
    repeats = 1 if interpreting() else REPEATS
    runner.history = None  # the passes overwrite the entries a next prompt could have resumed from
    samples = []
    for pattern, rows, topk in shapes:
        tokens = pattern.num_tokens
        longest = runner.cache.capacity - max(tokens, runner.max_commit) - 1
        lengths = [0] * repeats + ([longest] if longest >= MIN_SPAN and not interpreting() else [])
        for i, length in enumerate([0, *lengths]):  # the first pass is not timed: it prepares the shape
            runner.lengths = [length] * batch
            positions = tuple(length + 1 + j for j in range(rows))
            requests = None if sample is None else [SampleRequest(sample, 0, positions)] * batch
            start = time.perf_counter()
            runner.step_batch([[0] * tokens] * batch, pattern, [list(range(rows))] * batch, topk, requests)
            if i:  # the step's fetch has waited for the device
                samples.append((batch * tokens, length, time.perf_counter() - start))
    runner.reset(batch)
    return fit(samples)


def merged(old: Curve, new: Curve) -> Curve:
    """`old`'s knots (kept as the steps left them) with `new`'s beyond its range."""
    knots, base, per_position = list(old.knots), list(old.base), list(old.per_position)
    for k, b, p in zip(new.knots, new.base, new.per_position, strict=True):
        if k > knots[-1]:
            knots.append(k)
            base.append(b)
            per_position.append(p)
    return Curve(knots, base, per_position)


def cost_key(model, runner: CachedRunner) -> dict:
    """What a step's cost depends on, beyond the step: the cache file's key."""
    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    cfg = model.config
    return {"device": f"{device.type}:{name}", "dtype": str(model.dtype), "backend": model.attn_backend,
            "fusion": model.fusion, "threads": torch.get_num_threads(), "cuda_graphs": runner.cuda_graphs,
            "interpreted": interpreting(),
            "model": [cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim, cfg.intermediate_size, cfg.vocab_size],
            "versions": [torch.__version__, _version("triton"), _version("lookahead")]}


def cost_path(key: dict) -> Path:
    """The cache file of a key, under the user's cache folder."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()
    return default_cache_dir() / "costs" / f"{digest}.json"


def _chain(tokens: int) -> StepPattern:
    """A step of `tokens` tokens: the input token and a path of tokens - 1 draft nodes (plain: one token)."""
    return PLAIN_STEP if tokens == 1 else StepPattern(1, 2, tree_end=(tokens - 1,) * (tokens - 1))


@cache  # constant for the process: cost_key runs before every self-tuned generation
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"
