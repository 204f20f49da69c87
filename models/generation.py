"""`Llama.generate`: turns the caller's arguments into one `Request`, finds a runner (cache, graphs) for it, and hands
both to a driver of the decode loop (`decode` for one prompt, `decode_batch` for a list of prompts,
`decode_parallel` over a process group).

The model's runner is kept between generations (`Llama.runner`) and grown in powers of two, so its KV cache,
compiled kernels and captured CUDA graphs are reused. Calls on one model serialise on the model's lock: they share
that runner and its cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from lookahead.config import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.loop import PLAIN_STEP, GenerationResult, decode, decode_batch, full_pattern, static_steps
from lookahead.parallel import agree, decode_parallel, sub_step_patterns
from lookahead.request import Request, check_stream, parse_request
from lookahead.tuning import CostModel
from lookahead.tuning.store import Saver

from .runner import CachedRunner, StepForward, StepShape
from .tuning import cost_model_for


class Llama(StepForward, Protocol):
    """What generation needs of the model (`llama.Llama`) beyond what its runner does."""

    runner: CachedRunner | None
    draft_memory: DraftMemory
    lock: threading.RLock
    lm_head: nn.Linear
    cost_model: CostModel | None
    cost_saver: Saver

    def release(self) -> None: ...

    def merge_weights(self) -> bool: ...


MIN_CAPACITY = 256


def generate(model: Llama, prompt_ids: Any, *, stream: Callable | None = None, cuda_graph: bool = True,
             process_group=None, **options: Any) -> GenerationResult | list[GenerationResult]:
    """See `Llama.generate`; `options` are its request arguments (max_new_tokens, lookahead, temperature, top_k, top_p,
    seed, eos_token_id, static_step), checked once into a `Request`."""
    check_stream(stream)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")

    def build(ranks: int | None = None) -> Request:
        return parse_request(prompt_ids, vocab_size=model.config.vocab_size,
                             max_positions=model.config.max_position_embeddings,
                             default_eos=model.config.eos_token_id, device_type=model.device.type, ranks=ranks,
                             **options)

    with model.lock, torch.inference_mode():
        if process_group is not None:
            ranks = _world_size(process_group)
            request = agree(process_group, lambda: build(ranks), fingerprint(model))
            return decode_parallel(runner_for(model, request, cuda_graph), request, process_group, stream)
        request = build()
        runner = runner_for(model, request, cuda_graph)
        cost = cost_model_for(model, runner, request)
        drivers = {"cost": cost, "memory": model.draft_memory}  # the memory: read and written by warm generations only
        try:
            if request.batch:
                return decode_batch(runner, request, stream, **drivers)
            return decode(runner, request, stream, **drivers)
        finally:
            model.cost_saver.if_due(model.cost_model)


def warmup(model: Llama, lookahead: LookaheadConfig | str | None, max_tokens: int, cuda_graph: bool, batch: int,
           sampling: bool, process_group=None) -> None:
    """See `Llama.warmup`: the runner for the largest request, every step shape a generation of it can meet
    prepared (captured on CUDA), then one short generation that warms the prefill."""
    for name, value, low in (("max_tokens", max_tokens, 2), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not isinstance(sampling, bool):
        raise TypeError(f"sampling must be a bool, got {sampling!r}")
    limit = model.config.max_position_embeddings
    if max_tokens > limit:
        raise ValueError(f"max_tokens ({max_tokens}) exceeds the model's max_position_embeddings ({limit})")
    # the request a generation of that size makes: "auto" and the parallel checks resolved as generate does
    request = parse_request([[0]] * batch if batch > 1 else [0], vocab_size=model.config.vocab_size,
                            max_positions=limit, max_new_tokens=max_tokens - 1, lookahead=lookahead,
                            device_type=model.device.type,
                            ranks=None if process_group is None else _world_size(process_group))
    with model.lock:
        with torch.inference_mode():
            runner = runner_for(model, request, cuda_graph)
            steps = static_steps(request.lookahead)
            if process_group is not None:  # a rank's sub-steps, of every padded size (sampling adds no program)
                topk = steps[-1][2]
                shapes = [StepShape(sub, sub.num_tokens, 1, topk) for sub in sub_step_patterns(request.lookahead)]
            else:  # every self-tuned size; a batch meets every smaller batch size as its rows finish
                shapes = [StepShape(pattern, rows, size, topk, sample) for sample in {False, sampling}
                          for size in range(batch, 0, -1) for pattern, rows, topk in steps]
            runner.capture(shapes)
            if process_group is None:  # the cost model's curve for this request, measured now if there is none
                cost_model_for(model, runner, request)
        if process_group is None:  # the prefill gives one token, so two make exactly one step, of a shape above
            cold = request.lookahead and dataclasses.replace(request.lookahead, warm=False)  # nothing to remember
            generate(model, [0], max_new_tokens=2, lookahead=cold, eos_token_id=[], static_step=True,
                     cuda_graph=cuda_graph)


def runner_for(model: Llama, request: Request, cuda_graph: bool = True) -> CachedRunner:
    """The model's runner for the request (its prompts, their length, the full step of its lookahead configuration),
    rebuilt (capacity rounded up to a power of two) only when it cannot serve it; reset for a new generation."""
    model.merge_weights()  # parameters replaced since (load_state_dict(assign=True), ...): a new runner
    full = full_pattern(request.lookahead) if request.lookahead is not None else PLAIN_STEP
    step_tokens, max_commit, batch = full.num_tokens, full.max_commit, len(request.prompts)
    capacity = request.longest + step_tokens
    runner = model.runner
    if runner is None or not runner.fits(capacity, step_tokens, max_commit, batch):
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        rows = batch
        if runner is not None:  # keep what the old one could serve, so alternating requests do not rebuild
            step_tokens = max(step_tokens, runner.max_step_tokens)
            capacity = max(capacity, runner.cache.capacity)
            max_commit = max(max_commit, runner.max_commit)
            rows = max(batch, runner.cache.batch)
        model.release()  # free the old cache before allocating the new one
        del runner
        model.runner = CachedRunner(model, capacity, step_tokens, max_commit, cuda_graph, rows)
    runner = model.runner
    runner.cuda_graphs = cuda_graph and runner.can_graph  # graphs captured before stay for later generations
    runner.reset(batch)
    return runner


def _world_size(group) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first (or run under torchrun)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD) "
                        f"or None, got {type(group).__name__}")
    return dist.get_world_size(group)


def fingerprint(model: Llama) -> str:
    """A cheap identity of the model for checking that every rank holds the same one: its config, dtype and a
    strided sample of its output head's bits."""
    weight = model.lm_head.weight.detach().flatten()[::997].contiguous()
    sample = hashlib.blake2b(weight.view(torch.uint8).cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return f"{model.config!r}|{model.dtype}|{model.attn_backend}|{sample}"
