"""Device binding for CUDA work that follows the current device rather than its tensors' device."""

from __future__ import annotations

import contextlib

import torch


def device_binding(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device for the block (a no-op off CUDA).

    Triton launches on `torch.cuda.current_device()` and its current stream, and a new `torch.cuda.Stream` or a graph
    capture belongs to the current device too, whatever their tensors' device: a model on cuda:1 (a rank > 0, a
    `device_map` shard) must bind its device around them, or it launches on GPU 0 with pointers into GPU 1.
    Under `torch.compile` (a model's fusion "compile") it binds nothing: the compiled code guards its own device."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
