"""Lookahead attention kernels and their PyTorch references; imports only torch and triton.

`lookahead_attention` is the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1); `reference_attention`
and `lookahead_mask` are the SDPA reference built from the same `StepPattern` rules.
"""

from .commit import commit_accepted
from .pattern import StepPattern, lookahead_mask
from .reference import masked_attention, reference_attention

try:
    from .triton_attention import interpreting, lookahead_attention
except ImportError as _triton_missing:  # platforms without Triton keep the torch reference
    _reason = str(_triton_missing)

    def lookahead_attention(*args, **kwargs):
        """Unavailable: Triton could not be imported."""
        raise RuntimeError(f"lookahead_attention needs Triton, which failed to import ({_reason}); "
                           "use reference_attention instead")

    def interpreting() -> bool:
        return False


__all__ = [
    "StepPattern",
    "commit_accepted",
    "interpreting",
    "lookahead_attention",
    "lookahead_mask",
    "masked_attention",
    "reference_attention",
]
