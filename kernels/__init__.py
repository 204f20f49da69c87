"""Lookahead attention kernels and their PyTorch references; imports only torch and triton.

`lookahead_attention` is the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1) and `StepAttentionPlan` its
pre-checked launch path for a model's per-layer calls; `reference_attention` and `lookahead_mask` are the SDPA
reference built from the same `StepPattern` rules.
"""

from __future__ import annotations

from .commit import commit_accepted
from .device import device_binding
from .pattern import StepPattern, lookahead_mask
from .reference import masked_attention, reference_attention

try:
    from .triton_attention import StepAttentionPlan, interpreting, lookahead_attention
except ImportError as _triton_missing:  # platforms without Triton keep the torch reference
    _reason = str(_triton_missing)

    def lookahead_attention(*args, **kwargs):
        """Unavailable: Triton could not be imported."""
        raise RuntimeError(f"lookahead_attention needs Triton, which failed to import ({_reason}); "
                           "use reference_attention instead")

    def interpreting() -> bool:
        return False

    class StepAttentionPlan:
        """Unavailable: Triton could not be imported."""

        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError(f"StepAttentionPlan needs Triton, which failed to import ({_reason})")


__all__ = [
    "StepAttentionPlan",
    "StepPattern",
    "commit_accepted",
    "device_binding",
    "interpreting",
    "lookahead_attention",
    "lookahead_mask",
    "masked_attention",
    "reference_attention",
]
