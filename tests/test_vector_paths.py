"""The CPU kernels' vector paths against their portable loops, bitwise: the same sources built for this CPU (what the
package loads: AVX-512, AVX2 or NEON code where the CPU has them) and for the baseline of its architecture (no vector
extension beyond it, so the portable loops), the same inputs, the same bits. Each kernel's header promises it; this
holds it on whichever CPU the suite runs on, the paths the suite's machine cannot take aside (`quant.gemm` compares
its two paths at run time: tests/test_gguf.py)."""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch

from lookahead import cpp_build
from lookahead.kernels import cpu_kernels
from lookahead.kernels.block_attention import path_keys, query_slots

BASELINE = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "armv8-a", "arm64": "armv8-a"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(the package's build, the same sources built for the architecture's baseline), each a module."""
    assert cpu_kernels.available(), f"the CPU kernels did not build here: {cpu_kernels.failure()}"
    baseline = BASELINE.get(platform.machine())
    assert baseline is not None, f"no baseline -march known for {platform.machine()}: add it to BASELINE"
    native = cpu_kernels._extension()
    cflags = tuple(f"-march={baseline}" if flag == "-march=native" else flag for flag in native.cflags)
    assert cflags != native.cflags, "the package's build no longer says -march=native: update this test"
    portable = dataclasses.replace(native, prefix=f"{native.prefix}_portable", cflags=cflags,
                                   target=f"{native.target}-{baseline}", what="the CPU kernels, portable")
    return cpu_kernels.extension(), cpp_build.load(portable, tmp_path_factory.mktemp("portable-kernels"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_gemm_gives_the_portable_loops_bits(builds, dtype):
    """Every row count a tile takes (and more, split), a K of no round size, a partial column block; bfloat16 weights
    in the widening layout, the one both builds read (bf16 dot products are the native build's alone)."""
    native, portable = builds
    torch.manual_seed(8)
    packed = cpu_kernels.pack(torch.randn(200, 150).to(dtype), widen=True)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):
        x = torch.randn(rows, 150)
        assert torch.equal(native.rows_gemm(x, packed.blocks, packed.out_features),
                           portable.rows_gemm(x, packed.blocks, packed.out_features)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_the_attention_gives_the_portable_loops_bits(builds, dtype):
    """Queries seeing keys 0..i, as a run (a prompt chunk's rows side by side) and the last alone (a decoding step's
    few rows), head sizes in and out of 16s, a few keys and hundreds."""
    native, portable = builds
    torch.manual_seed(9)
    for heads, kv_heads, dim, n in ((9, 3, 64, 70), (4, 2, 16, 37), (6, 1, 24, 20), (12, 2, 32, 300), (32, 8, 64, 129)):
        k, v = torch.randn(kv_heads, n + 5, dim).to(dtype), torch.randn(kv_heads, n + 5, dim).to(dtype)
        q = torch.randn(n, heads, dim)
        slots, counts = query_slots(path_keys(0, n, lambda p: p, "cpu"), n)
        for rows in (slice(None), slice(n - 1, n)):
            args = (q[rows].contiguous(), k, v, slots[rows].contiguous(), counts[rows].contiguous())
            assert torch.equal(native.chain_attention(*args), portable.chain_attention(*args)), (heads, dim, n, rows)
