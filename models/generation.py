"""`Llama.generate`: turns the caller's arguments into one `Request`, finds a runner (the paged KV cache) for it, and
hands both to the engine (`decode_batch`: one prompt is a batch of one; every row joins at step 0), or to
`decode_parallel` over a process group.

The model's runner is kept between generations (`Llama.runner`) and grown in powers of two, so its KV cache, the
prefixes cached in it (a conversation's earlier turns, a shared system prompt) and its compiled kernels are reused.
Calls on one model serialise on the model's lock: they share that runner and its cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lookahead.config import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.loop import PLAIN_STEP, GenerationResult, decode_batch, full_pattern, static_steps
from lookahead.parallel import agree, decode_parallel, sub_step_patterns
from lookahead.request import GenerateArgs, Request, Target, check_stream, parse_request
from lookahead.tuning import CostModel
from lookahead.tuning.store import Saver

from .programs import StepShape
from .runner import BLOCK_SIZE, CachedRunner, StepForward
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


MIN_BLOCKS = 16  # the smallest pool a runner is built with (256 positions at 16 a block)


def generate(model: Llama, prompt_ids: Any, *, stream: Callable | None = None, cuda_graph: bool = True,
             process_group=None, **options: Any) -> GenerationResult | list[GenerationResult]:
    """See `Llama.generate`; `options` are its request arguments (max_new_tokens, lookahead, temperature, top_k, top_p,
    seed, eos_token_id, static_step), checked once into a `Request`."""
    check_stream(stream)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")

    def build(ranks: int | None = None) -> Request:
        return parse_request(prompt_ids, GenerateArgs(**options), _target(model, ranks))

    with model.lock, torch.inference_mode():
        if process_group is not None:
            ranks = _world_size(process_group)
            request = agree(process_group, lambda: build(ranks), fingerprint(model))
            sequence = runner_for(model, request, cuda_graph).sequence(_positions(request)[0])
            try:
                return decode_parallel(sequence, request, process_group, stream)
            finally:
                sequence.close()
        request = build()
        runner = runner_for(model, request, cuda_graph)
        cost = cost_model_for(model, runner, request)
        try:
            # the memory: read and written by warm generations only
            results = decode_batch(runner, request, stream, cost=cost, memory=model.draft_memory)
        finally:
            model.cost_saver.if_due(model.cost_model)
        return results if request.batch else results[0]


@dataclass(frozen=True)
class Expected:
    """The generations a warm-up prepares for (`Llama.warmup`): their lookahead, the most tokens of one (prompt and
    output), the most prompts at once, whether they sample, static steps (None: on CUDA); checked on construction."""

    lookahead: LookaheadConfig | str | None
    max_tokens: int
    batch: int = 1
    sampling: bool = False
    static_step: bool | None = None

    def __post_init__(self) -> None:
        for name, value, low in (("max_tokens", self.max_tokens, 2), ("batch", self.batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.sampling, bool):
            raise TypeError(f"sampling must be a bool, got {self.sampling!r}")


def warmup(model: Llama, expected: Expected, cuda_graph: bool, process_group=None) -> None:
    """See `Llama.warmup`: the runner for the largest request, every static shape its decoding steps can have (each
    a CUDA graph on CUDA), its cost model, then one short generation that warms the prefill and a step."""
    limit, batch = model.config.max_position_embeddings, expected.batch
    if expected.max_tokens > limit:
        raise ValueError(f"max_tokens ({expected.max_tokens}) exceeds the model's max_position_embeddings ({limit})")
    # the request a generation of that size makes: "auto" and the parallel checks resolved as generate does
    args = GenerateArgs(expected.max_tokens - 1, expected.lookahead, temperature=1.0 if expected.sampling else 0.0,
                        static_step=expected.static_step)
    ranks = None if process_group is None else _world_size(process_group)
    request = parse_request([[0]] * batch if batch > 1 else [0], args, _target(model, ranks))
    with model.lock:
        with torch.inference_mode():
            runner = runner_for(model, request, cuda_graph)
            if runner.static:  # every decoding step's shape, captured now (a CUDA graph each on CUDA)
                topk = static_steps(request.lookahead)[-1][2]
                if process_group is not None:  # a rank's sub-steps, of every padded size: every token a logits row
                    runner.capture([StepShape(sub.num_tokens, 1, sub.num_tokens, topk).padded()
                                    for sub in sub_step_patterns(request.lookahead)])
                else:
                    step = full_pattern(request.lookahead).num_tokens if request.lookahead is not None else 1
                    runner.capture(runner.decode_shapes(batch, step, topk))
            if process_group is None:  # the cost model's curve for this request, measured now if there is none
                cost_model_for(model, runner, request)
        if process_group is None:  # the prefill gives one token, so two make exactly one step
            cold = request.lookahead and dataclasses.replace(request.lookahead, warm=False)  # nothing to remember
            generate(model, [0], max_new_tokens=2, lookahead=cold, eos_token_id=[], static_step=request.static_step,
                     cuda_graph=cuda_graph)


def _target(model: Llama, ranks: int | None) -> Target:
    cfg = model.config
    return Target(cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id, model.device.type, ranks)


def _positions(request: Request) -> list[int]:
    """The positions each prompt's row may reach: the prompt, the new tokens and the largest step past them."""
    full = full_pattern(request.lookahead) if request.lookahead is not None else PLAIN_STEP
    return [len(prompt) + request.max_new_tokens + full.num_tokens for prompt in request.prompts]


def runner_for(model: Llama, request: Request, cuda_graph: bool = True) -> CachedRunner:
    """The model's runner for the request (all its prompts at once, with room for their new tokens and the full step of
    its lookahead configuration): grown (its pool to a power of two of blocks, its contents kept) when too small,
    rebuilt only when the model's dtype, device, backend or fusion changed; the pool, and the prefixes cached in it,
    stay across generations."""
    model.merge_weights()  # parameters replaced since (load_state_dict(assign=True), ...): a new runner
    full = full_pattern(request.lookahead) if request.lookahead is not None else PLAIN_STEP
    step_tokens, rows = full.num_tokens, len(request.prompts)
    blocks = sum(-(-positions // BLOCK_SIZE) for positions in _positions(request))
    runner = model.runner
    if runner is not None and not runner.serves(model):
        model.release()  # free the old pool before allocating the new one
        runner = None
    if runner is None:
        model.runner = runner = _sized(lambda size: CachedRunner(model, size, step_tokens, cuda_graphs=cuda_graph,
                                                                 max_rows=rows), blocks)
    elif blocks > runner.blocks.num_blocks or rows > runner.max_rows or step_tokens > runner.max_step_tokens:
        _sized(lambda size: runner.grow(max(size, runner.blocks.num_blocks), rows, step_tokens), blocks)
    runner.cuda_graphs = cuda_graph and runner.device.type == "cuda" and runner.backend.graphable
    runner.static = request.static_step  # padded to a few step shapes (CUDA's default), or exact sizes
    return runner


def _sized(build: Callable[[int], Any], blocks: int) -> Any:
    """`build(size)` with the pool rounded up to a power of two of blocks (so a growing conversation reallocates
    rarely), or, where memory holds that but not the rounding, with exactly the `blocks` needed: the check that refuses
    a request compares what it needs, not twice that."""
    rounded = max(MIN_BLOCKS, 1 << (blocks - 1).bit_length())
    try:
        return build(rounded)
    except ValueError:  # KVPool: not that much free memory
        if rounded <= max(MIN_BLOCKS, blocks):
            raise
    return build(max(MIN_BLOCKS, blocks))


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
    weight = model.lm_head.weight
    if weight.is_meta:  # kept only packed (`Llama.keep_weights_once`): its copy's bits
        weight = model.kept_weight(model.lm_head)
    weight = weight.detach().flatten()[::997].contiguous()
    sample = hashlib.blake2b(weight.view(torch.uint8).cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return f"{model.config!r}|{model.dtype}|{model.attn_backend}|{sample}"
