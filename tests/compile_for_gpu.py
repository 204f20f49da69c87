"""Compile the lookahead attention kernel for NVIDIA targets on a machine with no GPU (run as a script:
Triton's interpreter must be off, which the test process cannot undo once triton is imported).

Prints one line per (arch, dtype, head_dim): OK with the shared memory it needs, or FAILED with the error.
"""

import inspect
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lookahead.kernels.triton_attention import _lookahead_attn_fwd, launch_config

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_for(arch: int, dtype: torch.dtype, head_dim: int, window=15, ngram=5, guesses=15, group=4):
    params = list(inspect.signature(_lookahead_attn_fwd.fn).parameters)
    config = launch_config(window, ngram, guesses, group, head_dim, dtype)
    constants = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    constants.update(W=window, N=ngram, G=guesses, GROUP=group, HEAD_DIM=head_dim)
    signature = {}
    for name in params:
        if name in ("Q", "K", "V", "Out"):
            signature[name] = "*" + _TYPES[dtype]
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    source = ASTSource(fn=_lookahead_attn_fwd, signature=signature, constexprs=constants)
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


# Hopper in every dtype at D = 128, Ampere at D = 64; `--all` compiles every combination
DEFAULT = [(90, torch.float16, 128), (90, torch.bfloat16, 128), (90, torch.float32, 128), (80, torch.float16, 64)]


def main() -> int:
    failed = 0
    cases = DEFAULT
    if "--all" in sys.argv:
        cases = [(a, d, h) for a in (80, 90) for d in _TYPES for h in (64, 128)]
    for arch, dtype, head_dim in cases:
        try:
            kernel = compile_for(arch, dtype, head_dim)
            print(f"sm_{arch} {_TYPES[dtype]} D{head_dim} OK shared={kernel.metadata.shared}")
        except Exception as e:  # noqa: BLE001 - report every failure, whatever the compiler raised
            failed += 1
            print(f"sm_{arch} {_TYPES[dtype]} D{head_dim} FAILED {type(e).__name__}: {e}"[:2000])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
