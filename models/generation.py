"""`Llama.generate`: checks the request, sizes the cache, and runs the decode loop."""

from __future__ import annotations

import torch

from lookahead.config import LookaheadConfig
from lookahead.engine import GenerationResult, decode
from lookahead.sampling import SamplingParams

from .inputs import eos_ids, prompt_tokens
from .llama import Llama
from .runner import CachedRunner


def generate(model: Llama, prompt_ids, *, max_new_tokens: int, lookahead: LookaheadConfig | None,
             temperature: float, top_k: int, top_p: float, seed: int | None, eos_token_id,
             stream) -> GenerationResult:
    """See `Llama.generate`."""
    prompt = prompt_tokens(prompt_ids, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise TypeError(f"lookahead must be None or a LookaheadConfig, got {type(lookahead).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be callable or None, got {type(stream).__name__}")
    sampling = SamplingParams(temperature, top_k, top_p)
    limit = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{len(prompt) + max_new_tokens} exceeds the model's max_position_embeddings ({limit}); "
                         "shorten the prompt or lower max_new_tokens")
    eos = eos_ids(model.config.eos_token_id, eos_token_id)
    step_tokens = lookahead.max_step_tokens if lookahead is not None else 1
    runner = CachedRunner(model, capacity=len(prompt) + max_new_tokens + step_tokens, max_step_tokens=step_tokens)
    with torch.inference_mode():
        return decode(runner, prompt, max_new_tokens, sampling, lookahead, eos, stream, seed, model.device)
