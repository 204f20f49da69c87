"""Spawned ranks for tests/test_parallel.py: each loads the tiny checkpoint, joins a gloo group and runs the cases.

Kept apart from the test module so that the spawned processes import only this (no pytest, no transformers).
"""

from __future__ import annotations

import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def run_cases(rank: int, world: int, store: str, folder: str, cases: list, results, timeout: float) -> None:
    """Run `cases` [(name, kwargs for Llama.generate, {rank: overrides}, fail_at)] on this rank and put
    (rank, {name: (tokens, steps) or ("error", type, message)}) on `results`. fail_at: (rank, step): that rank's
    model raises at that forward step of the case; (rank, "stream"): its stream raises. kwargs may name
    "attn_backend" (the model's) and "warmup" (prepare the shapes first; the shapes the generation adds are
    reported)."""
    torch.set_num_threads(1)
    from lookahead.models import Llama
    from lookahead.models.runner import CachedRunner

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    models = {}
    original = CachedRunner.step
    out = {}
    for name, kwargs, overrides, fail_at in cases:
        calls = [0]

        def failing(self, *args, _calls=calls, _at=fail_at, **kw):
            _calls[0] += 1
            if _at is not None and _at[0] == rank and _calls[0] == _at[1]:
                raise RuntimeError(f"injected failure on rank {rank}")
            return original(self, *args, **kw)

        CachedRunner.step = failing
        if fail_at is not None and fail_at == (rank, "stream"):
            kwargs = {**kwargs, "stream": _failing_stream(rank)}
        start = time.perf_counter()
        try:
            args = {**kwargs, **overrides.get(rank, {})}
            backend = args.pop("attn_backend", "auto")
            if backend not in models:
                models[backend] = Llama.from_pretrained(folder, attn_backend=backend)
            model = models[backend]
            if args.pop("warmup", False):  # prepare every sub-step shape first; count what the generation adds
                model.release()  # nothing prepared by earlier cases
                model.warmup(args["lookahead"], max_tokens=64, process_group=dist.group.WORLD, static_step=True)
                prepared = set(model.runner.step_shapes)
            result = model.generate(**args, process_group=dist.group.WORLD)
            out[name] = (result.tokens, result.steps)
            if "prepared" in locals():
                out[name + ":new shapes"] = sorted(set(model.runner.step_shapes) - prepared)
                del prepared
        except Exception as e:  # reported to the test, which asserts on it
            out[name] = ("error", type(e).__name__, str(e), traceback.format_exc(limit=3))
        out[name + ":seconds"] = time.perf_counter() - start
        CachedRunner.step = original
    results.put((rank, out))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _failing_stream(rank: int):
    def stream(tokens):
        raise RuntimeError(f"stream failed on rank {rank}")

    return stream


def spawn(world: int, store: str, folder: str, cases: list, timeout: float = 20.0, wait: float = 120.0) -> list[dict]:
    """Run `cases` on `world` spawned ranks; each rank's results, in rank order. Processes still alive after `wait`
    seconds are killed (a hang fails the test instead of blocking it)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_cases, args=(rank, world, store, folder, cases, results, timeout), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + wait
    try:
        while len(got) < world:
            rank, out = results.get(timeout=max(0.1, deadline - time.monotonic()))
            got[rank] = out
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(range(world)) - set(got))
    if missing:
        raise TimeoutError(f"ranks {missing} gave no results within {wait} s")
    return [got[rank] for rank in range(world)]
