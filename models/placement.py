"""Where and in what a model runs, chosen once at load (`place`): the device, the dtype (and why it was chosen), the
attention backend, the fusion, and whether the batch-invariant mode is on by default (`Llama.from_pretrained` asks
these); and the warning when the mode that a 16-bit dtype was chosen for is switched off."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from lookahead.backends import choose_backend, choose_fusion
from lookahead.kernels import interpreting
from lookahead.kernels.cpu_kernels import bf16_dot_products, failure

from .invariant import runs_cpu_kernels

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_VARIABLE = "LOOKAHEAD_DTYPE"  # the environment's default dtype, where from_pretrained is given none


@dataclass(frozen=True)
class Placement:
    """What `place` chose for a model at load."""

    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # "asked for", or the rule of `default_dtype` that chose it (the CLI says it)
    attn_backend: str
    fusion: str
    batch_invariant: bool
    # a default 16-bit dtype chosen because the mode keeps it exact (without the mode the default is float32):
    # switching the mode off on the model warns (`warn_leaving_the_mode`)
    for_the_mode: bool


def place(device: torch.device | str, dtype: torch.dtype | str | None, attn_backend: str, fusion: str,
          batch_invariant: bool | None) -> Placement:
    """`Llama.from_pretrained`'s device, dtype (and why), attention backend, fusion and mode, each checked (see its
    docstring for what each may be), None and "auto" resolved for the device."""
    device = resolve_device(device)
    asked = None if dtype is None else resolve_dtype(dtype)
    backend = resolve_backend(attn_backend, device)
    if batch_invariant is not None and batch_invariant is not True and batch_invariant is not False:
        raise TypeError(f"batch_invariant must be True, False or None, got {batch_invariant!r}")
    if batch_invariant is None:
        batch_invariant = default_batch_invariant(device, fusion, backend)
    dtype, reason = (asked, "asked for") if asked is not None else default_dtype(device, batch_invariant)
    fusion = "none" if batch_invariant and fusion == "auto" else choose_fusion(fusion, device.type, backend,
                                                                              interpreting())
    check_invariant(batch_invariant, fusion)
    for_the_mode = asked is None and batch_invariant and default_dtype(device, batch_invariant=False)[0] != dtype
    return Placement(device, dtype, reason, backend, fusion, batch_invariant, for_the_mode)


def warn_leaving_the_mode(dtype: torch.dtype) -> None:
    """The warning of `Llama.batch_invariant` switched off on a model whose dtype was chosen for the mode, pointing at
    the line that switched it (past the setter and `nn.Module.__setattr__`, which calls it)."""
    warnings.warn(f"batch_invariant switched off on a model loaded in {str(dtype).removeprefix('torch.')} because the "
                  "batch-invariant mode keeps 16-bit exact: near-tied logits can now flip between a lookahead step, a "
                  "batch and a plain step, so tokens may part from plain greedy decoding's. To keep exactness keep the "
                  "mode on, or load with dtype=torch.float32", stacklevel=4)


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
