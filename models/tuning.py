"""A model's cost model (`Llama.cost_model`) on its runner: the thin adapter over `lookahead.tuning.measure` (which
decides what a request needs, times the steps and keys the cache file) that says how one step runs on the runner and
what describes the model.

The figures depend on the device, the model's shape, dtype, attention backend and fusion, the thread count, CUDA
graphs and the versions of torch, Triton and this package: that is the cache file's key (its name is a digest of it),
so another machine, model or setting measures anew, and a file whose key or figures do not match is measured again.
A cost model set by the user (`model.cost_model = CostModel(...)`, with an empty key) is used as it is. The files
and the saving are `lookahead.tuning.store`'s.
"""

from __future__ import annotations

import time

from lookahead.kernels import cpu_kernels, interpreting
from lookahead.loop import RowStep, path_step, static_steps
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request
from lookahead.tuning import Curve, buckets, knots_up_to
from lookahead.tuning import measure as shared

from .runner import CachedRunner, backend_name


def cost_model_for(model, runner: CachedRunner, request: Request):
    """The cost model a self-tuned request sizes its steps by (None for plain decoding or full-size steps), measuring
    what the model's cost model lacks for it: a curve of this kind of step up to the request's largest step."""
    cfg = request.lookahead
    if not shared.self_tuned(cfg):
        return None
    sizes = buckets(cfg) if request.static_step else knots_up_to(cfg.step_tokens)

    def measured() -> Curve:
        start = time.perf_counter()
        try:
            return measure(runner, request, sizes)
        finally:
            model.measuring_seconds += time.perf_counter() - start

    wanted = shared.Wanted(request.sampling.greedy, len(request.prompts) * sizes[-1])
    source = shared.Source(lambda: cost_key(model, runner), measured)
    model.cost_model = shared.cost_model_for(model.cost_model, cfg, wanted, source, model.cost_saver)
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
    largest = max(pattern.num_tokens for pattern, _, _ in shapes)
    need = batch * -(-(largest + 2) // runner.block_size)
    if runner.blocks.free < need or len(runner.rows) + batch > runner.max_rows:
        # a pool sized for short requests, the rest of it holding their rows and cached prefixes: room for the passes
        runner.grow(runner.blocks.num_blocks + max(0, need - runner.blocks.free),
                    max(runner.max_rows, len(runner.rows) + batch), runner.max_step_tokens)
    span = min(runner.blocks.free // batch, -(-(shared.MAX_SPAN + largest) // runner.block_size)) * runner.block_size
    rows = [runner.admit([], span)[0] for _ in range(batch)]

    def run(i: int, length: int) -> None:
        pattern, outputs, topk = shapes[i]
        steps = []
        for row in rows:
            runner.rows[row].length = length
            positions = tuple(length + 1 + j for j in range(outputs))
            steps.append(RowStep(row, [0] * pattern.num_tokens, pattern, list(range(outputs)), topk,
                                 None if sample is None else SampleRequest(sample, 0, positions)))
        runner.step(steps)  # its one fetch waits for the device

    try:
        for row in rows:
            runner.rows[row].tokens = None  # placeholders: never keyed
        sizes = [pattern.num_tokens for pattern, _, _ in shapes]
        return shared.time_steps(run, shared.Passes(sizes, batch, span - largest - 1, interpreting()))
    finally:
        for row in rows:
            runner.release(row)


def cost_key(model, runner: CachedRunner) -> dict:
    """What a step's cost depends on, beyond the step: the cache file's key."""
    cfg = model.config
    shape = [cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
             cfg.intermediate_size, cfg.vocab_size]
    # another build of the CPU kernels, other costs
    kernels = cpu_kernels.build_name() if model.uses_cpu_kernels else None
    return shared.cost_key(model.device, model.dtype, backend_name(model), shape, interpreting(), fusion=model.fusion,
                           cuda_graphs=runner.cuda_graphs, kernels=kernels)
