"""Lookahead attention kernels and their PyTorch references; imports only torch and triton.

`paged_attention` is the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1) over packed (varlen) steps, each row
with its own step, and a paged KV cache (block tables), and `PagedAttentionPlan` its pre-checked launch path for a
model's per-layer calls; `lookahead_attention` and `StepAttentionPlan` are the classic dense contract, one step shape
for every row, on the same kernel. `paged_reference_attention`, `reference_attention` and `lookahead_mask` are the
SDPA references built from the same `StepPattern` rules. `add_rms_norm`, `rotary_` and `silu_mul` are fused elementwise
kernels of a LLaMA layer (`fused.py`), with their torch references in `fused_reference.py`.
"""

from __future__ import annotations

from .commit import commit_accepted
from .device import device_binding
from .fused_reference import add_rms_norm_reference, rotary_reference, silu_mul_reference
from .pattern import StepPattern, lookahead_mask
from .reference import masked_attention, paged_reference_attention, reference_attention

try:
    from .dense_attention import StepAttentionPlan, lookahead_attention
    from .fused import add_rms_norm, rotary_, silu_mul
    from .paged_attention import paged_attention
    from .triton_attention import PagedAttentionPlan, interpreting
except ImportError as _triton_missing:  # platforms without Triton keep the torch reference
    _reason = str(_triton_missing)

    def lookahead_attention(*args, **kwargs):
        """Unavailable: Triton could not be imported."""
        raise RuntimeError(f"lookahead_attention needs Triton, which failed to import ({_reason}); "
                           "use reference_attention instead")

    def paged_attention(*args, **kwargs):
        """Unavailable: Triton could not be imported."""
        raise RuntimeError(f"paged_attention needs Triton, which failed to import ({_reason}); "
                           "use paged_reference_attention instead")

    def interpreting() -> bool:
        return False

    def _unavailable(name: str):
        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name} needs Triton, which failed to import ({_reason}); use {name}_reference")

        kernel.__doc__ = "Unavailable: Triton could not be imported."
        return kernel

    add_rms_norm, rotary_, silu_mul = (_unavailable(n) for n in ("add_rms_norm", "rotary", "silu_mul"))

    class StepAttentionPlan:
        """Unavailable: Triton could not be imported."""

        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError(f"StepAttentionPlan needs Triton, which failed to import ({_reason})")

    class PagedAttentionPlan:
        """Unavailable: Triton could not be imported."""

        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError(f"PagedAttentionPlan needs Triton, which failed to import ({_reason})")


__all__ = [
    "PagedAttentionPlan",
    "StepAttentionPlan",
    "StepPattern",
    "add_rms_norm",
    "add_rms_norm_reference",
    "commit_accepted",
    "device_binding",
    "interpreting",
    "lookahead_attention",
    "lookahead_mask",
    "masked_attention",
    "paged_attention",
    "paged_reference_attention",
    "reference_attention",
    "rotary_",
    "rotary_reference",
    "silu_mul",
    "silu_mul_reference",
]
