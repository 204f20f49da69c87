"""The work of `lookahead serve`: load the checkpoint and its tokenizer, put the model behind an engine of its own
(`lookahead.models.engine_for`), and serve it over HTTP (`lookahead.serve`) until SIGTERM or Ctrl-C, which end the
requests in flight and the process with status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

from lookahead.config import LookaheadConfig

from .generate import _backend, _device, _tokenizer
from .launch import world_size
from .report import dtype_choice, dtype_name

GIB = 2**30
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")  # what the [serve] extra installs
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's own index of CPU-only wheels (PyPI's are CUDA)
INSTALL_SERVE = ('pip install torch==2.13.0 && pip install -e ".[serve]" in the repository (torch first; PyPI\'s '
                 "torch is the 5 GB CUDA build: on a CPU-only machine take PyTorch's CPU wheel, pip install "
                 f"torch==2.13.0 --index-url {TORCH_CPU_INDEX})")


def run(args: argparse.Namespace) -> int:
    """Serve for `lookahead.cli`'s checked arguments; errors of the setup are raised for the front to print."""
    if world_size(os.environ) > 1:
        raise ValueError("lookahead serve runs in one process; unset WORLD_SIZE (torchrun is for lookahead generate)")
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:  # said before the model loads, naming the extra (not a bare "No module named 'fastapi'")
        raise ImportError(f"lookahead serve needs the [serve] extra ({', '.join(missing)} not installed): "
                          f"{INSTALL_SERVE}")
    raise_file_limit()
    _say(f"loading torch and {args.model or 'the default model'} ...")
    start = time.perf_counter()
    import torch

    from lookahead.models import Llama, default_model_dir, engine_for
    from lookahead.serve import Server, create_app, sampling_defaults

    device = _device(torch, args.device)
    folder = Path(args.model if args.model else default_model_dir(args.cache_dir))
    model = Llama.from_pretrained(folder, dtype=args.dtype, device=device,
                                  attn_backend=_backend(args.attn_backend, device),
                                  fusion=args.fusion, batch_invariant=args.batch_invariant)
    if model.uses_cpu_kernels:  # the mode's packed weights become the one copy: nothing here reads the others
        model.keep_weights_once()
    tokenizer = _tokenizer(folder)
    lookahead = lookahead_config(args, model.device.type)
    dtype = dtype_name(model)
    mode = ", batch-invariant" if model.batch_invariant else ""
    _say(f"loaded in {time.perf_counter() - start:.1f} s ({dtype}, {device}{mode}); preparing the "
         f"engine ({args.max_batch} rows{'' if lookahead is None else ', measuring step costs if not cached'})")
    if dtype_choice(model) is not None:
        _say(dtype_choice(model))
    if dtype != "float32" and lookahead is not None and not model.batch_invariant:
        _say(f"note: in {dtype} a greedy answer may differ from plain greedy decoding where two tokens are nearly "
             "tied (a multi-token pass rounds differently from a one-token pass); float32 is token-exact")
    kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * GIB)
    engine = engine_for(model, max_batch=args.max_batch, lookahead=lookahead, max_queue=args.max_queue,
                        kv_cache_bytes=kv_bytes, prefix_cache=not args.no_prefix_cache,
                        max_model_len=args.max_model_len)
    _check_cache(engine, engine.max_positions, args.kv_cache_gb)
    _say(kv_cache_line(engine, args.max_batch))
    name = args.served_model_name or folder.name
    app = create_app(engine, tokenizer, name, api_key=args.api_key,
                     eos_token_ids=model.config.eos_token_id, vocab_size=model.config.vocab_size,
                     max_body_bytes=args.max_body_bytes, sampling_defaults=sampling_defaults(folder),
                     allowed_origins=args.allowed_origins)
    mode = "plain decoding" if lookahead is None else (f"lookahead W={lookahead.window} N={lookahead.ngram} "
                                                       f"G={lookahead.guesses}")

    def started(server: Server) -> None:
        key = "; API key required" if args.api_key else ""
        _say(f"serving {name} ({mode}) on {server.url}/v1 for up to {args.max_batch} requests at once{key}; "
             "Ctrl-C stops")

    freeze_loaded()
    Server(app, args.host, args.port, log_level=args.log_level, on_started=started).run()
    _say("stopped")
    return 0


def freeze_loaded() -> None:
    """Take everything loaded so far (torch's, the model's, the tokenizer's and the app's objects: they live as long as
    the server) out of the garbage collector's view, after one last collection. Otherwise each full collection walks
    them all, a pause in the engine's thread that every stream waits out, and a long prompt's drafting tables
    (thousands of n-grams) set one off (vLLM and SGLang freeze theirs after start-up too)."""
    gc.collect()
    gc.freeze()


def lookahead_config(args: argparse.Namespace, device_type: str) -> LookaheadConfig | None:
    """What every request decodes with: the device's `LookaheadConfig.auto`, with the W, N, G given in its place."""
    if args.no_lookahead:
        return None
    auto = LookaheadConfig.auto(device_type)
    given = {name: getattr(args, name) for name in ("window", "ngram", "guesses") if getattr(args, name) is not None}
    return dataclasses.replace(auto, **given, **({"budget": "fixed"} if args.fixed_steps else {}))


def _check_cache(engine, max_positions: int, kv_cache_gb: float | None) -> None:
    """--kv-cache-gb must hold one sequence of the model's full length (else long requests could never start)."""
    runner = engine.model
    held = runner.capacity
    if held < max_positions + runner.max_step_tokens:
        raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds {held} positions, fewer than one sequence of the "
                         f"model's {max_positions} positions needs; raise it (or leave it out for the default)")


def kv_cache_line(engine, max_batch: int) -> str:
    """What the KV cache holds, said at start: its size, its positions, and how many requests of the full length."""
    runner = engine.model
    size = runner.pool.k.numel() * runner.pool.k.element_size() * 2 / GIB
    length = engine.max_positions
    full = runner.capacity // (length + runner.max_step_tokens)
    return (f"KV cache: {size:.2f} GiB, {runner.capacity} positions: {min(full, max_batch)} of the {max_batch} rows "
            f"can reach the full {length} positions at once (shorter requests share it; --kv-cache-gb or "
            "--max-model-len to change)")


def raise_file_limit(most: int = 65536) -> int:
    """Raise the process's soft limit of open files to its hard limit (at most `most`): each connection holds one,
    and the usual soft limit (1024) is reached by the server's connection cap. Returns the soft limit now."""
    try:
        import resource
    except ImportError:  # not on this system (Windows): nothing to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # the limit stays: the connection cap still holds
    return soft


def _say(message: str) -> None:
    print(f"lookahead: {message}", file=sys.stderr, flush=True)
