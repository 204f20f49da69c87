"""Where and in what a model runs, chosen once at load: the device, the dtype (and why it was chosen), the attention
backend, and whether the batch-invariant mode is on by default (`Llama.from_pretrained` asks these)."""

from __future__ import annotations

import os

import torch

from lookahead.backends import choose_backend
from lookahead.kernels import interpreting
from lookahead.kernels.cpu_kernels import bf16_dot_products, failure

from .invariant import runs_cpu_kernels

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_VARIABLE = "LOOKAHEAD_DTYPE"  # the environment's default dtype, where from_pretrained is given none


def check_invariant(batch_invariant: bool, fusion: str) -> None:
    if batch_invariant and fusion != "none":
        raise ValueError(f"batch_invariant=True runs the unfused forward (fusion='none'), got fusion={fusion!r}")


def default_batch_invariant(device: torch.device, fusion: str, attn_backend: str) -> bool:
    """The batch-invariant mode where it is the default: a CPU running the torch path (the torch attention backend,
    fusion "auto" or "none"), where the mode's compiled kernels are faster than torch's; not on CUDA, where it is
    unmeasured, nor for Triton under its interpreter (a kernel test's setting)."""
    return device.type == "cpu" and fusion in ("auto", "none") and attn_backend == "torch"


def default_dtype(device: torch.device, batch_invariant: bool) -> tuple[torch.dtype, str]:
    """The dtype a model loads in where none is given, and why (the CLI says it): $LOOKAHEAD_DTYPE where it is set;
    else bfloat16 on CUDA (the serving type); on a CPU, bfloat16 where the CPU has bf16 dot products
    (`cpu_kernels.bf16_dot_products`), the batch-invariant mode keeps 16-bit exact and its kernels are built (they read
    half the bytes a step reads in float32 and use those dot products: faster), else float32 (the exactness
    reference)."""
    named = os.environ.get(DTYPE_VARIABLE, "")
    if named:
        if named not in DTYPES:
            raise ValueError(f"{DTYPE_VARIABLE}={named!r} is not a dtype; set it to one of {', '.join(DTYPES)}, or "
                             "unset it for the default")
        return DTYPES[named], f"${DTYPE_VARIABLE}"
    if device.type == "cuda":
        return torch.bfloat16, "CUDA's default"
    feature = bf16_dot_products()
    if feature is None:
        return torch.float32, "this CPU has no bf16 dot products"
    if not batch_invariant:
        return torch.float32, "without the batch-invariant mode 16-bit may flip near-ties"
    if not runs_cpu_kernels(device):  # torch's GEMMs through row plans read bf16 weights as float32 copies: no faster
        return torch.float32, f"the package's CPU kernels could not be built here: {failure()}"
    return torch.bfloat16, f"this CPU has bf16 dot products ({feature}), and the batch-invariant mode keeps it exact"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32/float16/bfloat16 or their names; anything else is refused."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def resolve_device(device: torch.device | str) -> torch.device:
    """A CPU or CUDA torch device that exists here; "cuda" without a usable CUDA build or GPU is refused, and so
    is any other device type ("meta", "mps", ...)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({e})") from None
    if resolved.type not in ("cpu", "cuda"):  # meta holds no weights; mps, xpu, ... are not run here
        raise ValueError(f"device {str(device)!r} is not supported: the model runs on 'cpu' or 'cuda'")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r} is not available: {why} (torch {torch.__version__}); "
                             "use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available: {torch.cuda.device_count()} CUDA GPU(s) "
                             "visible")
    return resolved


def resolve_backend(attn_backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; "triton" on CPU needs the Triton interpreter."""
    return choose_backend(attn_backend, device.type, interpreting())
