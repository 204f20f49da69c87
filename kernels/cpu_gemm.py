"""A batch-invariant GEMM for the CPU, compiled at first use: every output a chain of fused multiply-adds over K in
order, from zero, whatever the number of rows, their place among them and the threads.

`pack(weight)` lays a weight [N, K] out once as [ceil(N / 64), K, 64] (column blocks; float32, or bfloat16 kept in
16 bits and widened in registers: half the bytes a token reads); `gemm(x, packed)` computes x [M, K] (float32) times
it, [M, N] float32. Threads split the column blocks; each block's rows go six at a time through one tile routine
whose arithmetic per output is the same for one row or six, so a row's bits depend on nothing but its own inputs (no
split of K, no kernel chosen by shape). A block's bytes are read once per six rows (six rows' accumulators and a row
of the block fill an AVX-512 register file): a one-token step reads the weight once, like a GEMV, and a longer step
reads it again from cache.

The source is compiled by torch's C++ extension loader (a C++ compiler and ninja) into `build_dir`; where that fails
`available` is False and callers use `row_plans` instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

COLUMNS = 64  # columns per block: four AVX-512 vectors of float32 per row
_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int NB = 64;

static inline float widen(float v) { return v; }
static inline float widen(uint16_t v) {  // bfloat16 -> float32: its bits are a float32's upper half
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// MR rows of x [.., K] times one column block [K, NB]: each output a fused multiply-add chain over k in order
template <int MR, typename W>
static void tile(const float* x, int64_t K, const W* block, float* out, int64_t N, int64_t col0) {
  float acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    float w[NB];
    const W* wk = block + k * NB;
    for (int n = 0; n < NB; ++n) w[n] = widen(wk[n]);
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * K + k];
      for (int n = 0; n < NB; ++n) acc[r][n] = std::fma(xv, w[n], acc[r][n]);
    }
  }
  const int64_t cols = std::min<int64_t>(NB, N - col0);
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * N + col0, acc[r], cols * sizeof(float));
}

template <typename W>
static void run(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N) {
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const W* block = w + b * K * NB;
      for (int64_t m = 0; m < M; m += 6) {
        const float* xm = x + m * K;
        float* om = out + m * N;
        switch (std::min<int64_t>(6, M - m)) {
          case 6: tile<6>(xm, K, block, om, N, b * NB); break;
          case 5: tile<5>(xm, K, block, om, N, b * NB); break;
          case 4: tile<4>(xm, K, block, om, N, b * NB); break;
          case 3: tile<3>(xm, K, block, om, N, b * NB); break;
          case 2: tile<2>(xm, K, block, om, N, b * NB); break;
          default: tile<1>(xm, K, block, om, N, b * NB); break;
        }
      }
    }
  });
}

torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor packed, int64_t n) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, n}, x.options());
  if (packed.scalar_type() == torch::kFloat32)
    run<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), out.data_ptr<float>(), n);
  else
    run<uint16_t>(x.data_ptr<float>(), M, K, reinterpret_cast<uint16_t*>(packed.data_ptr()),
                  out.data_ptr<float>(), n);
  return out;
}
"""
_module = None
_failed: str | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class Packed:
    """A weight [N, K] as column blocks [ceil(N / 64), K, 64] (float32, or bfloat16 bits as int16)."""

    blocks: torch.Tensor
    out_features: int


def pack(weight: torch.Tensor) -> Packed:
    """Lay a CPU weight [N, K] out for `gemm`: bfloat16 stays 16-bit, every other dtype becomes float32."""
    n, k = weight.shape
    w = weight.detach()
    w = w if w.dtype == torch.bfloat16 else w.float()
    pad = -n % COLUMNS
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    blocks = w.view(-1, COLUMNS, k).transpose(1, 2).contiguous()
    return Packed(blocks.view(torch.int16) if blocks.dtype == torch.bfloat16 else blocks, n)


def available(build_dir: str | os.PathLike | None = None) -> bool:
    """Whether the kernel is compiled (compiling it into `build_dir` on the first call; a failure warns once)."""
    return _load(build_dir) is not None


def gemm(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x [M, K] (float32, contiguous, on the CPU) times the packed weight: [M, N] float32. Call `available` first."""
    return _module.rows_gemm(x, packed.blocks, packed.out_features)


def _cpu_tag() -> str:
    """A short hash of this CPU's model and flags: the build is for this CPU alone (-march=native), so a cache folder
    shared by machines keeps one build per kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        facts = "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        facts = platform.processor()
    return hashlib.sha256(facts.encode()).hexdigest()[:12]


def _load(build_dir):
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                name = f"lookahead_rows_gemm_{_cpu_tag()}"
                folder = None
                if build_dir is not None:
                    folder = Path(build_dir)
                    folder.mkdir(parents=True, exist_ok=True)
                    if not (folder / f"{name}.so").is_file():  # a long silence otherwise
                        print(f"lookahead: compiling the batch-invariant CPU GEMM for this machine into {folder} "
                              "(once; about a minute)", file=sys.stderr, flush=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _module = load_inline(name, cpp_sources=_SOURCE, functions=["rows_gemm"],
                                          extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                                          extra_ldflags=["-fopenmp"],
                                          build_directory=None if folder is None else str(folder), verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only folder: the slower row plans instead
                _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(f"lookahead: the CPU GEMM kernel could not be compiled ({_failed}); the batch-invariant "
                              "mode uses torch's GEMMs through verified row counts instead (slower)", stacklevel=3)
    return _module
