"""A model's cost model (`Llama.cost_model`): read from the disk cache, or measured on the model's own runner, before
the first self-tuned generation that needs it; saved back as the steps keep it current.

The figures depend on the device, the model's shape, dtype, attention backend and fusion, the thread count, CUDA
graphs and the versions of torch, Triton and this package: that is the cache file's key (its name is a digest of it),
so another machine, model or setting measures anew, and a file whose key or figures do not match is measured again.
A cost model set by the user (`model.cost_model = CostModel(...)`, with an empty key) is used as it is. The files
and the saving are `lookahead.tuning.store`'s.
"""

from __future__ import annotations

import time

import torch

from lookahead.kernels import interpreting
from lookahead.loop import RowStep, path_step, static_steps
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request
from lookahead.tuning import Curve, buckets, fit, knots_up_to
from lookahead.tuning.store import device_label, prepared, versions

from .runner import CachedRunner

REPEATS = 3  # timed passes per step size at the shortest cache length (one at the longest): a median
MIN_SPAN = 256  # cache positions between the two lengths timed; below it the cost per position is not measured
MAX_SPAN = 2048  # the longer cache length timed, at most


def cost_model_for(model, runner: CachedRunner, request: Request):
    """The cost model a self-tuned request sizes its steps by (None for plain decoding or full-size steps), measuring
    what the model's cost model lacks for it: a curve of this kind of step up to the request's largest step."""
    cfg = request.lookahead
    if cfg is None or cfg.budget != "auto" or cfg.form != "tree":
        return None
    cost = model.cost_model
    if cost is not None and not cost.key:
        return cost  # the user's
    kind = "greedy" if request.sampling.greedy else "sampling"
    sizes = buckets(cfg) if request.static_step else knots_up_to(cfg.step_tokens)
    model.cost_model = prepared(cost, cost_key(model, runner), kind, len(request.prompts) * sizes[-1],
                                lambda: measure(runner, request, sizes), model.cost_saver)
    return model.cost_model


def measure(runner: CachedRunner, request: Request, sizes: list[int]) -> Curve:
    """Time steps of `sizes` tokens per row (the request's batch, its top-k and sampling) on the runner, at two
    cache lengths, and fit a curve in tokens per step (all rows). Static steps time the shapes the generation will
    run (each bucket's); otherwise a tree of each size. The passes run on scratch rows of free blocks, whose entries
    are placeholders and whose blocks are never keyed; they are released after."""
    cfg, batch = request.lookahead, len(request.prompts)
    sample = None if request.sampling.greedy else request.sampling
    if request.static_step:
        shapes = static_steps(cfg)
    else:
        topk = static_steps(cfg)[-1][2]
        shapes = [(path_step(size), size, topk) for size in sizes]
    repeats = 1 if interpreting() else REPEATS
    largest = max(pattern.num_tokens for pattern, _, _ in shapes)
    span = min(runner.blocks.free // batch, -(-(MAX_SPAN + largest) // runner.block_size)) * runner.block_size
    rows = [runner.admit([], span)[0] for _ in range(batch)]
    samples = []
    try:
        for row in rows:
            runner.rows[row].tokens = None  # placeholders: never keyed
        for pattern, outputs, topk in shapes:
            tokens = pattern.num_tokens
            longest = span - tokens - 1
            lengths = [0] * repeats + ([longest] if longest >= MIN_SPAN and not interpreting() else [])
            for i, length in enumerate([0, *lengths]):  # the first pass is not timed: it prepares the shape
                steps = []
                for row in rows:
                    runner.rows[row].length = length
                    positions = tuple(length + 1 + j for j in range(outputs))
                    steps.append(RowStep(row, [0] * tokens, pattern, list(range(outputs)), topk,
                                         None if sample is None else SampleRequest(sample, 0, positions)))
                start = time.perf_counter()
                runner.step(steps)
                if i:  # the step's fetch has waited for the device
                    samples.append((batch * tokens, length, time.perf_counter() - start))
    finally:
        for row in rows:
            runner.release(row)
    return fit(samples)


def cost_key(model, runner: CachedRunner) -> dict:
    """What a step's cost depends on, beyond the step: the cache file's key."""
    cfg = model.config
    return {"device": device_label(model.device), "dtype": str(model.dtype), "backend": model.attn_backend,
            "fusion": model.fusion, "threads": torch.get_num_threads(), "cuda_graphs": runner.cuda_graphs,
            "interpreted": interpreting(),
            "model": [cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim, cfg.intermediate_size, cfg.vocab_size],
            "versions": [torch.__version__, *versions("triton", "lookahead")]}
