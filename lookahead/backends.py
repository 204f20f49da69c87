"""Which attention implementation runs a step, and how the ops around it are fused: the one rule each, for the model,
the transformers adapter and the CLI.

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


FUSIONS = ("auto", "none", "triton", "compile")


def choose_fusion(requested: str, device_type: str, attn_backend: str, interpreting: bool = False) -> str:
    """How a forward runs the small ops around its GEMMs and attention (norms, RoPE, residual adds, SiLU).

    "none": the torch ops, one kernel each (the CPU path). "triton": merged q/k/v and gate/up GEMMs with hand-fused
    Triton kernels (`lookahead.kernels.fused`). "compile": the same merged GEMMs with the torch ops, the step's
    forward under `torch.compile(fullgraph=True, dynamic=False)`. "auto" -> "triton" on CUDA with the Triton
    attention backend, "none" elsewhere: the kernels need no compile per step shape (self-tuned steps capture
    many shapes x batch sizes, each a recompile under `dynamic=False`), run the same code every time, and capture
    into CUDA graphs as the attention kernel does. "triton" on a CPU runs only under Triton's interpreter, as
    attn_backend does. ValueError names anything else."""
    if requested not in FUSIONS:
        raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}; got {requested!r}")
    if requested == "auto":
        return "triton" if device_type == "cuda" and attn_backend == "triton" else "none"
    if requested == "triton" and device_type == "cpu" and not interpreting:
        raise ValueError("fusion='triton' on CPU needs Triton's interpreter (set TRITON_INTERPRET=1 before importing "
                         "lookahead); use fusion='none' (or 'auto') on CPU")
    return requested
