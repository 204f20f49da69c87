"""Compile the lookahead attention kernels (and the fused elementwise kernels) for NVIDIA targets on a machine with no
GPU, exactly as they launch (run as a script: Triton's interpreter must be off, which the test process cannot undo
once triton is imported).

The launches are captured from a real `StepAttentionPlan` call on CPU tensors shaped like the model's (q a
transposed view of [B, T, Hq, D], k/v a [B, Hkv, S, D] cache), or from a `PagedAttentionPlan` call on a packed batch
over a block pool (`PAGED`: k/v a permuted view of a per-layer [Hkv, num_blocks * block_size, D] buffer, int32 block
tables), then specialised as Triton's launcher does at run time (16-byte divisible pointers and ints, ints equal to 1
folded, `do_not_specialize` honoured), so the compiled kernel is the one that would run. Prints one line per (arch,
dtype, head dim, step): OK with registers, spilled (stack) bytes, shared memory and whether async copies / wgmma are
used, for the split and merge kernels; or FAILED.

    python tests/compile_for_gpu.py          # the cases the test suite checks (DEFAULT)
    python tests/compile_for_gpu.py --all    # every step shape x fp16/bf16 x sm_90/sm_80, fp32, D 64 and 256

The fused kernels (`lookahead.kernels.fused`: add + RMSNorm, RoPE, SiLU-mul) are captured the same way from one call
each on an 8B layer's and SmolLM2's activations, and reported one line per (arch, dtype, model).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

import lookahead.kernels.fused as fused
import lookahead.kernels.triton_attention as launcher
from lookahead.kernels import PagedAttentionPlan, StepAttentionPlan, StepPattern

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")
SHAPE = dict(batch=1, heads_q=32, heads_kv=8, max_len=4096)  # an 8B-class model's attention


class _Capture:
    """Stands in for a kernel global: records (kernel, args, kwargs) of each launch instead of running it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def captured_launches(step: StepPattern | dict, dtype: torch.dtype, head_dim: int, arch: int) -> list:
    """The (kernel, args, kwargs) of one plan call with the model's layouts, tiles chosen for `arch`: a
    `StepAttentionPlan` for a pattern, a `PagedAttentionPlan` for a `PAGED` batch."""
    launches: list = []
    saved = {name: getattr(launcher, name) for name in ("_lookahead_attn_split", "_lookahead_attn_merge",
                                                        "launch_config")}
    try:
        for name in ("_lookahead_attn_split", "_lookahead_attn_merge"):
            setattr(launcher, name, _Capture(saved[name], launches))
        # the plan asks the device for its capability; here the target's stands in
        launcher.launch_config = lambda tokens, group, head_dim, dtype, capability=None: saved["launch_config"](
            tokens, group, head_dim, dtype, (arch // 10, arch % 10))
        if isinstance(step, StepPattern):
            call_step_plan(step, dtype, head_dim)
        else:
            call_paged_plan(step, dtype, head_dim)
    finally:
        for name, value in saved.items():
            setattr(launcher, name, value)
    return launches


def call_step_plan(pattern: StepPattern, dtype: torch.dtype, head_dim: int) -> None:
    b, hq, hkv, max_len, t = *SHAPE.values(), pattern.num_tokens
    plan = StepAttentionPlan(pattern, batch=b, heads_q=hq, heads_kv=hkv, head_dim=head_dim, dtype=dtype,
                             device=torch.device("cpu"), max_len=max_len)
    q = torch.empty(b, t, hq, head_dim, dtype=dtype).transpose(1, 2)
    k = torch.empty(b, hkv, max_len + t, head_dim, dtype=dtype)
    plan(q, k, torch.empty_like(k), torch.full((b,), max_len // 2), None)


def call_paged_plan(batch: dict, dtype: torch.dtype, head_dim: int) -> None:
    """A packed batch of `rows` rows of `row_tokens` tokens each over a pool of `block_size`-position blocks, the
    pool a permuted view of the per-layer [Hkv, num_blocks * block_size, D] buffer the model keeps."""
    rows, row_tokens, block_size = batch["rows"], batch["row_tokens"], batch["block_size"]
    hq, hkv, max_len = SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["max_len"]
    max_blocks = -(-(max_len + row_tokens) // block_size)
    plan = PagedAttentionPlan(heads_q=hq, heads_kv=hkv, head_dim=head_dim, dtype=dtype, device=torch.device("cpu"),
                              max_rows=rows, max_row_tokens=row_tokens, max_len=max_len)
    tokens = rows * row_tokens
    q = torch.empty(tokens, hq, head_dim, dtype=dtype)
    pool = torch.empty(hkv, rows * max_blocks * block_size, head_dim, dtype=dtype)
    k = pool.view(hkv, rows * max_blocks, block_size, head_dim).permute(1, 0, 2, 3)
    ints = dict(dtype=torch.int32)
    table = torch.arange(rows * max_blocks, **ints).view(rows, max_blocks)
    cu = torch.arange(rows + 1, **ints) * row_tokens
    plan(q, k, k, table, cu, torch.full((rows,), max_len // 2, **ints), torch.ones(rows, **ints),
         torch.full((rows,), 2, **ints), torch.zeros(tokens, **ints))


def compile_launch(kernel, args, kwargs, arch: int):
    """Compile one captured launch as JITFunction.run would: same signature, constexprs and attributes."""
    backend = CUDABackend(GPUTarget("cuda", arch, 32))
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
    bound.apply_defaults()
    values = list(bound.arguments.values())
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, values, strict=True)):
        if param.is_constexpr:
            kind, attr = "constexpr", None
        else:
            kind, attr = native_specialize_impl(backend, value, param.is_const, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def describe(compiled) -> str:
    """Registers and stack (spilled) bytes per thread from the cubin (cuobjdump, so cached kernels report too),
    shared memory, warps, and which async-copy / tensor-core instructions the PTX uses."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    ops = [name for name, op in (("cp.async", "cp.async."), ("tma", "cp.async.bulk.tensor"), ("wgmma", "wgmma."),
                                 ("mma", "mma.sync")) if op in ptx]
    return (f"regs {found.get('REG', '?')}, spill {found.get('STACK', '?')} B, smem {compiled.metadata.shared} B, "
            f"warps {compiled.metadata.num_warps}, {'+'.join(ops) or 'no async copy / mma'}")


def compile_case(arch: int, dtype: torch.dtype, head_dim: int, step: StepPattern | dict) -> str:
    parts = []
    for kernel, args, kwargs in captured_launches(step, dtype, head_dim, arch):
        compiled = compile_launch(kernel, args, kwargs, arch)
        parts.append(f"{kernel.fn.__name__.removeprefix('_lookahead_attn_')}: {describe(compiled)}")
    return " | ".join(parts)


STEPS = {"W15-N5-G15": StepPattern(15, 5, 15), "W3-N4-G3": StepPattern(3, 4, 3), "plain": StepPattern(1, 2, 0),
         "W3-N4-tree9": StepPattern(3, 4, tree_end=(4, 3, 3, 4, 7, 6, 7, 8, 9)),
         # the package default (1, 4, 5): a 15-node tree, T = 18; a 64-token lookahead-parallel sub-step (W = 1, N = 2)
         "W1-N4-tree15": StepPattern(1, 4, tree_end=(6, 3, 3, 5, 5, 6, 11, 8, 9, 10, 11, 13, 13, 15, 15)),
         "substep64": StepPattern(1, 2, tree_end=(8, 3, 3, 5, 5, 8, 7, 8, *range(9, 64))),
         "W15-N5-tree60": StepPattern(15, 5, tree_end=tuple(range(1, 61)))}
# packed batches over a paged pool (block size 16): a decode batch of 16 rows of the default step (18 tokens), and
# 4 prefill chunks of 512 tokens
PAGED = {"paged-decode16": dict(rows=16, row_tokens=18, block_size=16),
         "paged-prefill512": dict(rows=4, row_tokens=512, block_size=16)}
STEPS.update(PAGED)
# what the test suite checks: the default, 15-5-15 and sub-step shapes in both 16-bit types on Hopper, the rest once;
# the paged batches on both archs, in both 16-bit types and head dims 64 and 128
DEFAULT = [(90, torch.bfloat16, 128, "W1-N4-tree15"), (90, torch.float16, 128, "W1-N4-tree15"),
           (90, torch.bfloat16, 128, "W15-N5-G15"), (90, torch.float16, 128, "W15-N5-G15"),
           (90, torch.bfloat16, 128, "substep64"), (90, torch.bfloat16, 128, "W15-N5-tree60"),
           (90, torch.bfloat16, 128, "W3-N4-G3"), (90, torch.float16, 128, "plain"),
           (90, torch.bfloat16, 128, "W3-N4-tree9"), (80, torch.bfloat16, 128, "W1-N4-tree15"),
           (80, torch.float16, 128, "W15-N5-G15"), (80, torch.bfloat16, 128, "substep64"),
           (90, torch.bfloat16, 128, "paged-decode16"), (90, torch.float16, 64, "paged-decode16"),
           (90, torch.bfloat16, 128, "paged-prefill512"), (80, torch.float16, 128, "paged-decode16"),
           (80, torch.bfloat16, 64, "paged-decode16"), (80, torch.float16, 64, "paged-prefill512")]
ALL = [(a, d, 128, s) for a in (90, 80) for d in (torch.float16, torch.bfloat16) for s in STEPS]
ALL += [(a, d, 64, s) for a in (90, 80) for d in (torch.float16, torch.bfloat16) for s in PAGED]
ALL += [(90, torch.float32, 128, s) for s in STEPS] + [(90, torch.float16, d, "W3-N4-G3") for d in (64, 256)]


# (hidden, q heads, KV heads, head dim, intermediate) of the models the fused kernels serve, at the default step's 18
# tokens
MODELS = {"8B": (4096, 32, 8, 128, 14336), "SmolLM2": (576, 9, 3, 64, 1536)}
FUSED_DEFAULT = [(90, torch.bfloat16, "8B"), (90, torch.float16, "8B"), (80, torch.bfloat16, "8B"),
                 (80, torch.float16, "8B"), (90, torch.bfloat16, "SmolLM2")]
FUSED_ALL = [(a, d, m) for a in (90, 80) for d in (torch.float16, torch.bfloat16) for m in MODELS]


def captured_fused_launches(dtype: torch.dtype, model: str, tokens: int = 18) -> list:
    """The (kernel, args, kwargs) of one call of each fused kernel on a layer's activations, as the model lays them
    out (q and k views of the merged q/k/v projection; [B, T] positions)."""
    hidden, heads_q, heads_kv, head_dim, inter = MODELS[model]
    launches: list = []
    names = ("_add_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel")
    saved = {name: getattr(fused, name) for name in (*names, "interpreting")}
    try:
        for name in names:
            setattr(fused, name, _Capture(saved[name], launches))
        fused.interpreting = lambda: True  # CPU tensors stand in for the device's; nothing runs
        x = torch.empty(1, tokens, hidden, dtype=dtype)
        fused.add_rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-5, torch.empty_like(x))
        qkv = torch.empty(1, tokens, heads_q + 2 * heads_kv, head_dim, dtype=dtype)
        q, k, _ = qkv.split((heads_q, heads_kv, heads_kv), dim=2)
        fused.rotary_(q, k, torch.zeros(1, tokens, dtype=torch.int64), torch.empty(head_dim // 2))
        fused.silu_mul(torch.empty(1, tokens, 2 * inter, dtype=dtype))
    finally:
        for name, value in saved.items():
            setattr(fused, name, value)
    return launches


def compile_fused_case(arch: int, dtype: torch.dtype, model: str) -> str:
    parts = []
    for kernel, args, kwargs in captured_fused_launches(dtype, model):
        compiled = compile_launch(kernel, args, kwargs, arch)
        parts.append(f"{kernel.fn.__name__.strip('_').removesuffix('_kernel')}: {describe(compiled)}")
    return " | ".join(parts)


def main() -> int:
    failed = 0
    every = "--all" in sys.argv
    cases = [(f"sm_{arch} {_TYPES[dtype]} D{head_dim} {step}", compile_case, (arch, dtype, head_dim, STEPS[step]))
             for arch, dtype, head_dim, step in (ALL if every else DEFAULT)]
    cases += [(f"sm_{arch} {_TYPES[dtype]} fused {model}", compile_fused_case, (arch, dtype, model))
              for arch, dtype, model in (FUSED_ALL if every else FUSED_DEFAULT)]
    for name, compile_one, args in cases:
        try:
            print(f"{name} OK {compile_one(*args)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, whatever the compiler raised
            failed += 1
            print(f"{name} FAILED {type(e).__name__}: {e}"[:2000], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
