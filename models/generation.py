"""`Llama.generate`: checks the request, finds a runner (cache, graphs) for it, and runs the decode loop
(`lookahead.engine.decode` for one prompt, `lookahead.batch.decode_batch` for a list of prompts).

The model's runner is kept between generations (on the model) and grown in powers of two, so its KV
cache, compiled kernels and captured CUDA graphs are reused.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from lookahead.batch import auto_lookahead, decode_batch, row_seeds
from lookahead.config import LookaheadConfig
from lookahead.engine import PLAIN_STEP, GenerationResult, decode
from lookahead.inputs import eos_ids, prompt_batch, prompt_tokens
from lookahead.layout import full_pattern
from lookahead.parallel import decode_parallel, scaled_lookahead, step_capacity
from lookahead.sampling import SamplingParams

from .runner import CachedRunner

if TYPE_CHECKING:
    from .llama import Llama

MIN_CAPACITY = 256


def generate(model: Llama, prompt_ids, *, max_new_tokens: int, lookahead: LookaheadConfig | str | None,
             temperature: float, top_k: int, top_p: float, seed: int | list[int] | None, eos_token_id,
             stream, static_step: bool | None, cuda_graph: bool, process_group=None,
             kv_sync: str = "broadcast") -> GenerationResult | list[GenerationResult]:
    """See `Llama.generate`. kv_sync: how lookahead parallelism brings accepted KV entries to every rank
    (`lookahead.parallel`; "broadcast" measured faster than the authors' "refeed")."""
    prompts = prompt_batch(prompt_ids, model.config.vocab_size)
    batch = prompts is not None
    if prompts is None:
        prompts = [prompt_tokens(prompt_ids, model.config.vocab_size)]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if process_group is not None:
        lookahead = _check_parallel(process_group, batch, lookahead)
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
    static = model.device.type == "cuda" if static_step is None else static_step
    if process_group is not None:
        step_tokens, commit = step_capacity(lookahead)
        runner = runner_for(model, len(prompts[0]) + max_new_tokens, lookahead, cuda_graph, 1, step_tokens, commit)
        with torch.inference_mode():
            return decode_parallel(runner, prompts[0], max_new_tokens, process_group, sampling, lookahead, eos, stream,
                                   seed, model.device, static, kv_sync, fingerprint(model))
    runner = runner_for(model, max(map(len, prompts)) + max_new_tokens, lookahead, cuda_graph, len(prompts))
    with torch.inference_mode():
        if batch:
            return decode_batch(runner, prompts, max_new_tokens, sampling, lookahead, eos, stream, seeds,
                                model.device)
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
               batch: int = 1, step_tokens: int = 0, commit: int = 0) -> CachedRunner:
    """The model's runner for `batch` sequences of up to `tokens` tokens, rebuilt (capacity rounded up to a
    power of two) only when it cannot serve this. step_tokens, commit: at least these many tokens a step and
    entries a commit (a lookahead-parallel sub-step with re-fed tokens holds more than the configuration's step)."""
    full = full_pattern(lookahead) if lookahead is not None else PLAIN_STEP
    step_tokens = max(step_tokens, full.num_tokens)
    max_commit = max(commit, full.max_commit)
    capacity = tokens + step_tokens
    runner: CachedRunner | None = model.__dict__.get("_runner")
    if runner is None or not runner.fits(capacity, step_tokens, max_commit, batch):
        old = runner
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        if old is not None:  # keep what the old one could serve, so alternating configs do not rebuild
            step_tokens = max(step_tokens, old.max_step_tokens)
            capacity = max(capacity, old.cache.capacity)
        max_commit = max(max_commit, old.max_commit if old is not None else 1)
        rows = max(batch, old.cache.batch if old is not None else 1)
        model.__dict__["_runner"] = None  # free the old cache before allocating the new one
        del old, runner
        runner = CachedRunner(model, capacity, step_tokens, max_commit, cuda_graph, rows)
        model.__dict__["_runner"] = runner
    runner.cuda_graphs = cuda_graph and runner.can_graph  # graphs captured before stay for later generations
    runner.reset(batch)
    return runner


def _check_parallel(process_group, batch: bool, lookahead) -> LookaheadConfig:
    """The whole step's configuration for lookahead parallelism over `process_group`; refuses what it cannot run."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first (or run under torchrun)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD) "
                        f"or None, got {type(process_group).__name__}")
    if batch:
        raise ValueError("process_group: lookahead parallelism decodes one prompt; give one prompt, not a batch")
    ranks = dist.get_world_size(process_group)
    if isinstance(lookahead, str) and lookahead == "auto":
        return scaled_lookahead(LookaheadConfig(), ranks)
    if not isinstance(lookahead, LookaheadConfig):
        raise ValueError(f"process_group: lookahead parallelism divides a lookahead step among the ranks; give a "
                         f"LookaheadConfig (it describes the whole step) or 'auto', got {lookahead!r}")
    return lookahead


def fingerprint(model: Llama) -> str:
    """A cheap identity of the model for checking that every rank holds the same one: its config, dtype and a
    strided sample of its output head's bits."""
    weight = model.lm_head.weight.detach().flatten()[::997].contiguous()
    sample = hashlib.blake2b(weight.view(torch.uint8).cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return f"{model.config!r}|{model.dtype}|{model.attn_backend}|{sample}"
