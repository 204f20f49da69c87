"""`engine_for`: a `Llama` behind an `Engine` of its own, for serving many requests at once (the server's, or a
program's own).

The engine gets a runner of its own (its own paged KV cache, sized here: by `kv_cache_bytes`, else for `max_batch` rows
of `max_model_len` within a share of the free memory and a multiple of the weights' size) and a drafting memory of its
own, so it never shares them with `Llama.generate` calls on the same model, which keep the model's runner. It shares the
weights and the machine's cost model (measured here, before the first request, if the cache folder has none).
"""

from __future__ import annotations

import torch

from lookahead.config import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.loop import PLAIN_STEP, Capacity, Engine, full_pattern
from lookahead.request import Request

from .generation import Llama
from .kv_cache import KVShape, free_bytes
from .runner import BLOCK_SIZE, CachedRunner
from .tuning import cost_model_for

MEMORY_SHARE = 0.4  # of the free memory, the most a default-sized KV cache takes
# the most a default-sized KV cache takes beyond KV_FLOOR_BYTES, as a multiple of the weights' bytes: a small model's
# full-length rows cost far more than the model itself (8 rows of SmolLM2-135M's 8192 positions: 3 GB of RAM beside
# 0.5 GB of weights), and most requests are far shorter
WEIGHTS_MULTIPLE = 2
KV_FLOOR_BYTES = 2**30


def engine_for(model: Llama, *, max_batch: int = 8, lookahead: LookaheadConfig | str | None = "auto",
               max_queue: int | None = 256, kv_cache_bytes: int | None = None, warm: bool = True,
               prefix_cache: bool = True, max_model_len: int | None = None,
               batch_invariant: bool | None = None) -> Engine:
    """An `Engine` over `model` for up to `max_batch` rows at once and `max_queue` waiting requests (None: no limit).

    lookahead: the configuration requests may decode with ("auto": `LookaheadConfig.auto` for the model's device; None:
    plain decoding only); it sizes the runner's steps and the cost model measured, and the engine keeps it
    (`engine.lookahead`: what a server's requests decode with). kv_cache_bytes: the KV cache's size
    (default: `max_batch` rows of `max_model_len`, at most `MEMORY_SHARE` of the free memory and the larger of
    `WEIGHTS_MULTIPLE` times the weights' bytes and `KV_FLOOR_BYTES`, at least one such row; `engine.model.capacity`
    says how many positions it holds). max_model_len: the positions a request may reach, prompt and answer (default: the
    model's max_position_embeddings; less makes a smaller cache hold more requests at once). warm: rows draft from a
    memory of what earlier requests taught (shared by all rows, bounded). prefix_cache: a prompt takes the cached KV
    blocks it begins with (False: every prompt prefills whole, for comparison). batch_invariant: switch the model's
    mode (`Llama.batch_invariant`: every answer bitwise what the request gives alone, in every dtype) before the engine
    is built; None keeps the model's. Start it with `engine.start()` (or drive it with `engine.step()`);
    `engine.stop()` ends it."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if isinstance(lookahead, str) and lookahead == "auto":
        lookahead = LookaheadConfig.auto(model.device.type)
    if lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise TypeError(f"lookahead must be a LookaheadConfig, 'auto' or None, got {lookahead!r}")
    if batch_invariant is not None:
        model.batch_invariant = batch_invariant
    cfg = model.config
    if max_model_len is None:
        max_model_len = cfg.max_position_embeddings
    elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len:
        raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
    elif max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); give at most that")
    step = full_pattern(lookahead).num_tokens if lookahead is not None else PLAIN_STEP.num_tokens
    row_blocks = -(-(max_model_len + step) // BLOCK_SIZE)
    per_block = KVShape.of(cfg).bytes(model.dtype, BLOCK_SIZE)
    if kv_cache_bytes is None:
        free = free_bytes(model.device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        fits = max(WEIGHTS_MULTIPLE * weights, KV_FLOOR_BYTES) // per_block
        if free is not None:
            fits = min(fits, int(free * MEMORY_SHARE) // per_block)
        blocks = max(row_blocks, min(max_batch * row_blocks, fits))
    else:
        if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < per_block:
            raise ValueError(f"kv_cache_bytes must be an int >= one block ({per_block} bytes), got {kv_cache_bytes!r}")
        blocks = kv_cache_bytes // per_block
    with model.lock, torch.inference_mode():
        model.merge_weights()
        runner = CachedRunner(model, blocks, step, cuda_graphs=True, max_rows=max_batch)
        runner.prefix_cache = prefix_cache
        if lookahead is not None:  # the cost model a self-tuned step is sized by, measured now if there is none
            cost = cost_model_for(model, runner, Request([[0]] * min(max_batch, 4), 1, lookahead=lookahead))
        else:
            cost = model.cost_model
    capacity = Capacity(max_batch, max_queue, max_model_len, cfg.vocab_size, lookahead)
    return Engine(runner, capacity=capacity, cost=cost, memory=DraftMemory() if warm else None)
