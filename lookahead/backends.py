"""Which attention implementation runs a step: the one rule, for the model, the transformers adapter and the CLI.

Loads no torch (the CLI reads `BACKENDS` before torch is imported)."""

from __future__ import annotations

BACKENDS = ("auto", "torch", "triton")


def choose_backend(requested: str, device_type: str, interpreting: bool = False) -> str:
    """"auto" -> "triton" on CUDA, "torch" (SDPA with the pattern's mask) elsewhere; "triton" on a CPU runs only
    under Triton's interpreter (TRITON_INTERPRET=1, `interpreting`). ValueError names anything else."""
    if requested not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if requested == "triton" and device_type == "cpu" and not interpreting:
        raise ValueError("attn_backend='triton' on CPU needs Triton's interpreter (set TRITON_INTERPRET=1 before "
                         "importing lookahead); use attn_backend='torch' (or 'auto') on CPU")
    return requested
