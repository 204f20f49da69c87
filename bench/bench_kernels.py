"""Micro-benchmark of one layer's lookahead attention: the Triton kernel (through `StepAttentionPlan`, the model's
path) side by side with flex_attention (the same pattern as a mask_mod), SDPA with the dense bool mask, and, when
installed, FlashAttention's `flash_attn_with_kvcache` (causal, same token count) as a speed reference.

    python bench/bench_kernels.py [--impls triton,flex,sdpa,fa] [--lengths 256,1024] [--steps plain,1-4-5]
    python -m pytest bench/bench_kernels.py -s        # the same table (saved to a temporary folder)

On GPU: B = 1, Hq 32 / Hkv 8, D 128, bf16, L in {256, 1k, 4k, 16k, 32k} x the steps plain (T = 1), the package
default 1-4-5 (a 15-node tree, T = 18), 3-4-3 (T = 18), 7-5-7 (T = 56) and 15-5-15 (T = 120); reports the
median time (triton.testing.do_bench), effective TB/s (K/V bytes read / time), TFLOPS (visible query-key pairs x
4D) and, on a known GPU, time over the HBM floor (K/V bytes / peak bandwidth). On CPU it runs tiny shapes so it
still works; there the Triton kernel runs in its interpreter (TRITON_INTERPRET=1), so CPU timings mean nothing.
Each row also gives the kernel's tiling (`tile_plan`: rows per tile, K/V passes, splits). Results go to
bench/results/kernels-<device>.json with the machine, versions and commit (the pytest form writes a temporary
folder, so a test run changes no file of the checkout).

The fused elementwise kernels (`lookahead.kernels.fused`) against the torch ops they replace, as pytest-benchmark
groups (one per kernel and model shape, the implementations side by side):

    python -m pytest bench/bench_kernels.py -k fused --benchmark-group-by=group

On GPU: bf16 activations of an 8B layer and of SmolLM2 at the default step's 18 tokens, CUDA-synchronised rounds.
On CPU: tiny fp32 shapes, the Triton side in its interpreter (the timings mean nothing; they check the code runs).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

import common  # noqa: E402
from common import machine, print_table, save_json  # noqa: E402
from lookahead.kernels import (  # noqa: E402
    StepAttentionPlan,
    StepPattern,
    add_rms_norm,
    add_rms_norm_reference,
    masked_attention,
    rotary_,
    rotary_reference,
    silu_mul,
    silu_mul_reference,
)
from lookahead.kernels.triton_attention import tile_plan  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
STEPS = {  # the package default's tree: 5 candidates of 3 tokens (the chains layout as a tree, T = 1 x 3 + 15)
    "plain": StepPattern(1, 2, 0), "1-4-5": StepPattern(1, 4, tree_end=tuple(3 * (j // 3) + 3 for j in range(15))),
    "3-4-3": StepPattern(3, 4, 3), "7-5-7": StepPattern(7, 5, 7), "15-5-15": StepPattern(15, 5, 15),
}
if GPU:
    SHAPE = dict(heads_q=32, heads_kv=8, head_dim=128, dtype=torch.bfloat16)
    LENGTHS, NAMES = [256, 1024, 4096, 16384, 32768], list(STEPS)
else:
    SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64, dtype=torch.float16)
    LENGTHS, NAMES = [64, 256], ["plain", "1-4-5"]
HBM_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}  # peak bandwidth (SXM parts) for the floor column
IMPLS = ["triton", "flex", "sdpa", "fa"]


def make_case(name: str, L: int):
    pattern = STEPS[name]
    T = pattern.num_tokens
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, dtype = SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"]
    q = torch.randn(1, T, hq, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # as the model passes it
    k = torch.randn(1, hkv, L + T, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(1, hkv, L + T, d, generator=gen).to(DEVICE, dtype)
    return pattern, q, k, v


def triton_runner(pattern, q, k, v, L):
    plan = StepAttentionPlan(pattern, batch=1, heads_q=q.shape[1], heads_kv=k.shape[1], head_dim=q.shape[3],
                             dtype=q.dtype, device=q.device, max_len=L)
    lengths = torch.full((1,), L, dtype=torch.int64, device=q.device)
    return lambda: plan(q, k, v, lengths)


def flex_runner(pattern, q, k, v, L):
    """flex_attention with the pattern as a mask_mod (attention-gym style), the block mask built outside timing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < L) | pattern.visible(q_idx, kv_idx - L)

    t = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, t, L + t, device=DEVICE)
    fn = torch.compile(flex_attention, dynamic=False) if GPU else flex_attention
    qc = q.contiguous()
    return lambda: fn(qc, k, v, block_mask=block_mask, enable_gqa=True)


def sdpa_runner(pattern, q, k, v, L):
    mask = pattern.materialize(L, device=DEVICE)  # built once, outside the timing
    return lambda: masked_attention(q, k, v, L, mask)


def fa_runner(pattern, q, k, v, L):
    """FlashAttention's decoding kernel, causal over the same tokens (a speed reference, not the same pattern)."""
    from flash_attn import flash_attn_with_kvcache

    q_bthd, k_bshd, v_bshd = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    seqlens = torch.full((1,), L + q.shape[2], dtype=torch.int32, device=DEVICE)
    return lambda: flash_attn_with_kvcache(q_bthd, k_bshd, v_bshd, cache_seqlens=seqlens, causal=True)


RUNNERS = {"triton": triton_runner, "flex": flex_runner, "sdpa": sdpa_runner, "fa": fa_runner}


def time_us(fn) -> float:
    """Median microseconds: triton.testing.do_bench on GPU (synchronises), a few timed calls on CPU."""
    if GPU:
        import triton.testing

        return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[1]


def work(pattern: StepPattern, L: int) -> tuple[int, int]:
    """(K/V bytes read, FLOPs of the visible query-key pairs: 4 D per pair per query head)."""
    hq, hkv, d = SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"]
    t = pattern.num_tokens
    size = torch.finfo(SHAPE["dtype"]).bits // 8
    step_pairs = int(pattern.materialize(0).sum())
    return 2 * hkv * (L + t) * d * size, 4 * d * hq * (t * L + step_pairs)


def floor_tbps() -> float | None:
    name = torch.cuda.get_device_name() if GPU else ""
    return next((tbps for key, tbps in HBM_TBPS.items() if key in name), None)


def run(impls=IMPLS, lengths=LENGTHS, names=NAMES) -> list[dict]:
    rows, peak = [], floor_tbps()
    for name in names:
        for L in lengths:
            pattern, q, k, v = make_case(name, L)
            kv_bytes, flops = work(pattern, L)
            tiles = tile_plan(pattern, max_len=L, **SHAPE)
            for impl in impls:
                row = dict(step=name, T=pattern.num_tokens, L=L, impl=impl)
                if impl == "triton":
                    row.update(rows_per_tile=tiles.rows_per_tile, kv_passes=tiles.kv_passes, splits=tiles.splits)
                try:
                    us = time_us(RUNNERS[impl](pattern, q, k, v, L))
                    row.update(us=round(us, 2), tbps=round(kv_bytes / us / 1e6, 3), tflops=round(flops / us / 1e6, 2))
                    if peak:
                        row["x_floor"] = round(us / (kv_bytes / peak / 1e6), 2)
                except ImportError as e:
                    row["error"] = f"not installed ({e.name})"
                except Exception as e:  # noqa: BLE001 - an unavailable baseline is a row, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                rows.append(row)
            del q, k, v
    return rows


def report(rows: list[dict]) -> None:
    headers = ["step", "T", "L", "impl", "us", "TB/s", "TFLOPS", "x floor", "K/V passes"]
    keys = ("us", "tbps", "tflops", "x_floor", "kv_passes")
    table = [[r["step"], r["T"], r["L"], r["impl"], *(r.get(key, "-") for key in keys)]
             if "error" not in r else [r["step"], r["T"], r["L"], r["impl"], r["error"], "", "", "", ""] for r in rows]
    print()
    print_table(headers, table)
    path = save_json("kernels", {"machine": machine(), "shape": {k: str(v) for k, v in SHAPE.items()}, "rows": rows})
    print(f"saved {path}")
    if not GPU:
        print("note: on CPU the Triton kernel runs in its interpreter; its timings here mean nothing.")


def test_kernel_table(tmp_path, monkeypatch):
    """`pytest bench/bench_kernels.py -s` prints the same table (and saves it under a temporary folder)."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    report(run())


# (hidden, q heads, KV heads, head dim, intermediate, tokens) of the fused kernels' cases
FUSED_SHAPES = ({"8B": (4096, 32, 8, 128, 14336, 18), "SmolLM2": (576, 9, 3, 64, 1536, 18)} if GPU
                else {"tiny": (72, 3, 1, 12, 100, 5)})
FUSED_DTYPE = torch.bfloat16 if GPU else torch.float32


def fused_case(kernel: str, impl: str, shape: tuple):
    """A no-argument callable running one fused kernel ("triton") or the torch ops it replaces ("torch") on a
    layer's activations."""
    hidden, heads_q, heads_kv, head_dim, inter, tokens = shape
    gen = torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(DEVICE, FUSED_DTYPE)

    if kernel == "add_rms_norm":
        x, residual, weight = randn(1, tokens, hidden), randn(1, tokens, hidden), randn(hidden)
        fn = add_rms_norm if impl == "triton" else add_rms_norm_reference
        return lambda: fn(x, weight, 1e-5, residual)
    if kernel == "rotary":
        qkv = randn(1, tokens, heads_q + 2 * heads_kv, head_dim)
        q, k, _ = qkv.split((heads_q, heads_kv, heads_kv), dim=2)
        positions = torch.arange(4096, 4096 + tokens, device=DEVICE)[None]
        inv_freq = (1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(DEVICE)
        fn = rotary_ if impl == "triton" else rotary_reference
        return lambda: fn(q, k, positions, inv_freq)
    gate_up = randn(1, tokens, 2 * inter)
    return (lambda: silu_mul(gate_up)) if impl == "triton" else (lambda: silu_mul_reference(gate_up))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("kernel", ["add_rms_norm", "rotary", "silu_mul"])
@pytest.mark.parametrize("model", list(FUSED_SHAPES))
def test_fused(benchmark, model, kernel, impl):
    """One fused kernel against the torch ops it replaces (which launch 2 to 6 kernels)."""
    run = fused_case(kernel, impl, FUSED_SHAPES[model])

    def run_and_sync():
        run()
        if GPU:
            torch.cuda.synchronize()

    benchmark.group = f"{kernel} {model}"  # implementations side by side
    benchmark.extra_info["device"] = machine()["device"]
    benchmark.pedantic(run_and_sync, rounds=200 if GPU else 3, warmup_rounds=10 if GPU else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cache prefix lengths L")
    parser.add_argument("--steps", default=",".join(NAMES), help=f"steps, of {','.join(STEPS)}")
    args = parser.parse_args()
    if GPU:  # one flex compilation per shape: keep them all rather than fall back to eager
        torch._dynamo.config.cache_size_limit = 64
    report(run(args.impls.split(","), [int(x) for x in args.lengths.split(",")], args.steps.split(",")))


if __name__ == "__main__":
    main()
