"""Micro-benchmarks of the lookahead attention: the Triton kernel vs SDPA with a dense bool mask vs
flex_attention with the same pattern as a mask_mod, side by side (pytest-benchmark groups per case).

    python -m pytest bench/bench_kernels.py --benchmark-json bench/results/kernels-cuda.json -s

On GPU: 8B-class heads (Hq 32, Hkv 8, D 128), fp16, (W, N, G) in {(15,5,15), (7,5,7), (5,4,5)} x L in
{256, 1024, 4096}. On CPU the same file runs small shapes so it stays runnable; there the Triton kernel
runs in the interpreter (TRITON_INTERPRET=1), so its CPU timings mean nothing.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import triton  # noqa: E402

from common import machine, print_table, save_json  # noqa: E402
from lookahead.kernels import StepPattern, lookahead_attention, masked_attention  # noqa: E402
from lookahead.kernels.triton_attention import block_sizes  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
if GPU:
    SHAPE = dict(heads_q=32, heads_kv=8, head_dim=128, dtype=torch.float16)
    CASES = [(w, n, g, L) for (w, n, g) in [(15, 5, 15), (7, 5, 7), (5, 4, 5)] for L in (256, 1024, 4096)]
else:
    SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64, dtype=torch.float32)
    CASES = [(5, 4, 5, 64), (7, 5, 7, 128)]
IDS = [f"W{w}-N{n}-G{g}-L{L}" for w, n, g, L in CASES]


def make_case(W, N, G, L):
    gen = torch.Generator().manual_seed(0)
    t = StepPattern(W, N, G).num_tokens
    hq, hkv, d, dtype = SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"]
    q = torch.randn(1, hq, t, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(1, hkv, L + t, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(1, hkv, L + t, d, generator=gen).to(DEVICE, dtype)
    return q, k, v


def flex_runner(q, k, v, W, N, G, L):
    """flex_attention with the pattern as a mask_mod (attention-gym style); None where unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    pattern = StepPattern(W, N, G)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < L) | pattern.visible(q_idx, kv_idx - L)

    t = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, t, L + t, device=DEVICE)
    fn = torch.compile(flex_attention) if GPU else flex_attention
    return lambda: fn(q, k, v, block_mask=block_mask, enable_gqa=True)


def implementations(case):
    W, N, G, L = case
    q, k, v = make_case(W, N, G, L)
    mask = StepPattern(W, N, G).materialize(L, device=DEVICE)  # built once, outside the timing
    return {
        "triton": lambda: lookahead_attention(q, k, v, L, W, N, G),
        "sdpa_dense_mask": lambda: masked_attention(q, k, v, L, mask),
        "flex": flex_runner(q, k, v, W, N, G, L),
    }


def synced(fn):
    def run():
        out = fn()
        if GPU:
            torch.cuda.synchronize()
        return out

    return run


@pytest.mark.parametrize("impl", ["triton", "sdpa_dense_mask", "flex"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_step_attention(benchmark, impl, case):
    run = implementations(case)[impl]
    if run is None:
        pytest.skip("flex_attention is not available in this torch")
    try:
        run()
    except Exception as e:  # noqa: BLE001 - flex on CPU may be unsupported in some torch builds
        pytest.skip(f"{impl} failed to run here: {type(e).__name__}: {e}")
    benchmark.group = IDS[CASES.index(case)]
    benchmark.extra_info.update(machine())
    benchmark.extra_info["block_pairs_computed"] = block_pair_fraction(*case)
    benchmark.pedantic(synced(run), rounds=50 if GPU else 3, warmup_rounds=5 if GPU else 1)


def block_pair_fraction(W, N, G, L) -> float:
    """Query/key block pairs the kernel computes, over those a dense masked kernel would (mirrors its loops)."""
    pattern = StepPattern(W, N, G)
    group = SHAPE["heads_q"] // SHAPE["heads_kv"]
    block_m, block_n = block_sizes(W, N, G, group, SHAPE["head_dim"], SHAPE["dtype"])
    t = pattern.num_tokens
    rows = t * group
    visible = pattern.materialize(0)
    computed = dense = 0
    for m0 in range(0, rows, block_m):
        tokens = torch.arange(m0, min(m0 + block_m, rows)) // group
        computed += triton.cdiv(L, block_n)  # the prefix: every block
        last = int(tokens.max())
        for n0 in range(0, last + 1, block_n):
            computed += bool(visible[tokens][:, n0 : min(n0 + block_n, t)].any())
        dense += triton.cdiv(L + t, block_n)
    return computed / dense


def test_print_block_pair_fractions():
    """The table of block pairs computed against a dense masked kernel, for every case."""
    rows = [[f"W{w}-N{n}-G{g}", L, f"{block_pair_fraction(w, n, g, L):.3f}"] for w, n, g, L in CASES]
    print()
    print_table(["W-N-G", "L", "block pairs computed / dense"], rows)
    save_json("block-pairs", {"machine": machine(), "shape": {k: str(v) for k, v in SHAPE.items()}, "rows": rows})
    if not GPU:
        print("note: on CPU the Triton kernel runs in its interpreter; its timings here mean nothing.")
