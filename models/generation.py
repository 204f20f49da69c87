"""`Llama.generate`: checks the request, finds a runner (cache, graphs) for it, and runs the decode loop
(`lookahead.engine.decode` for one prompt, `lookahead.batch.decode_batch` for a list of prompts).

The model's runner is kept between generations (on the model) and grown in powers of two, so its KV
cache, compiled kernels and captured CUDA graphs are reused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lookahead.batch import auto_lookahead, decode_batch, row_seeds
from lookahead.config import LookaheadConfig
from lookahead.engine import PLAIN_STEP, GenerationResult, decode
from lookahead.inputs import eos_ids, prompt_batch, prompt_tokens
from lookahead.layout import full_pattern
from lookahead.sampling import SamplingParams

from .runner import CachedRunner

if TYPE_CHECKING:
    from .llama import Llama

MIN_CAPACITY = 256


def generate(model: Llama, prompt_ids, *, max_new_tokens: int, lookahead: LookaheadConfig | str | None,
             temperature: float, top_k: int, top_p: float, seed: int | list[int] | None, eos_token_id,
             stream, static_step: bool | None, cuda_graph: bool) -> GenerationResult | list[GenerationResult]:
    """See `Llama.generate`."""
    prompts = prompt_batch(prompt_ids, model.config.vocab_size)
    batch = prompts is not None
    if prompts is None:
        prompts = [prompt_tokens(prompt_ids, model.config.vocab_size)]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(lookahead, str) and lookahead == "auto":
        lookahead = auto_lookahead(len(prompts), model.device.type)
    elif lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise TypeError(f"lookahead must be None, 'auto' or a LookaheadConfig, got {lookahead!r}")
    if batch:
        seeds = row_seeds(seed, len(prompts))
        if static_step is False:
            raise ValueError("static_step=False: a batch always runs static steps (every row at the full pattern, "
                             "one shape per step); leave static_step at None or True")
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None for one prompt (a list of seeds is for a batch), got {seed!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be callable or None, got {type(stream).__name__}")
    for name, flag in (("static_step", static_step), ("cuda_graph", cuda_graph)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool{' or None' if name == 'static_step' else ''}, got {flag!r}")
    sampling = SamplingParams(temperature, top_k, top_p)
    limit = model.config.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > limit:
            name = f"prompt_ids[{i}]" if batch else "prompt"
            raise ValueError(f"{name} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{len(prompt) + max_new_tokens} exceeds the model's max_position_embeddings ({limit}); "
                             "shorten the prompt or lower max_new_tokens")
    eos = eos_ids(model.config.eos_token_id, eos_token_id)
    runner = runner_for(model, max(map(len, prompts)) + max_new_tokens, lookahead, cuda_graph, len(prompts))
    with torch.inference_mode():
        if batch:
            return decode_batch(runner, prompts, max_new_tokens, sampling, lookahead, eos, stream, seeds,
                                model.device)
        static = model.device.type == "cuda" if static_step is None else static_step
        return decode(runner, prompts[0], max_new_tokens, sampling, lookahead, eos, stream, seed, model.device,
                      static_step=static)


def warmup(model: Llama, lookahead: LookaheadConfig | None, max_tokens: int, cuda_graph: bool) -> None:
    """See `Llama.warmup`: one short generation with static steps builds everything a longer one reuses."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
    runner_for(model, max_tokens, lookahead, cuda_graph)
    # the prefill gives one token, so two make exactly one step, of the one shape static steps have
    generate(model, [0], max_new_tokens=2, lookahead=lookahead, temperature=0.0, top_k=0, top_p=1.0,
             seed=None, eos_token_id=[], stream=None, static_step=True, cuda_graph=cuda_graph)


def runner_for(model: Llama, tokens: int, lookahead: LookaheadConfig | None, cuda_graph: bool,
               batch: int = 1) -> CachedRunner:
    """The model's runner for `batch` sequences of up to `tokens` tokens, rebuilt (capacity rounded up to a
    power of two) only when it cannot serve this."""
    full = full_pattern(lookahead) if lookahead is not None else PLAIN_STEP
    step_tokens = full.num_tokens
    capacity = tokens + step_tokens
    runner: CachedRunner | None = model.__dict__.get("_runner")
    if runner is None or not runner.fits(capacity, step_tokens, full.max_commit, batch):
        old = runner
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        if old is not None:  # keep what the old one could serve, so alternating configs do not rebuild
            step_tokens = max(step_tokens, old.max_step_tokens)
            capacity = max(capacity, old.cache.capacity)
        max_commit = max(full.max_commit, old.max_commit if old is not None else 1)
        rows = max(batch, old.cache.batch if old is not None else 1)
        model.__dict__["_runner"] = None  # free the old cache before allocating the new one
        del old, runner
        runner = CachedRunner(model, capacity, step_tokens, max_commit, cuda_graph, rows)
        model.__dict__["_runner"] = runner
    runner.cuda_graphs = cuda_graph and runner.can_graph  # graphs captured before stay for later generations
    runner.reset(batch)
    return runner
