"""A batch-invariant GEMM for the CPU, compiled at first use: every output a chain of fused multiply-adds over K in
order, from zero, whatever the number of rows, their place among them and the threads.

`pack(weight)` lays a weight [N, K] out once as [ceil(N / 64), K, 64] (column blocks; float32, or bfloat16 kept in
16 bits and widened in registers: half the bytes a token reads); `gemm(x, packed)` computes x [M, K] (float32) times
it, [M, N] float32. Threads split the column blocks; each block's rows go six at a time through one tile routine
whose arithmetic per output is the same for one row or six, so a row's bits depend on nothing but its own inputs (no
split of K, no kernel chosen by shape). A block's bytes are read once per six rows (six rows' accumulators and a row
of the block fill an AVX-512 register file): a one-token step reads the weight once, like a GEMV, and a longer step
reads it again from cache. `attention(...)`, in the same extension, is the batch-invariant attention on the CPU (each
query over its own keys in position order: `block_attention`'s contract as fused multiply-add chains), and
`decoder_layers(...)` runs a LLaMA model's layers over one packed step in one call (the same ATen ops as the Python
layers, with these kernels, so the same bits).

The source is compiled by torch's C++ extension loader (a C++ compiler and ninja) into `build_dir`; where that fails
`available` is False and callers use `row_plans` instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

COLUMNS = 64  # columns per block: four AVX-512 vectors of float32 per row
_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <unistd.h>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
static inline void relax() { _mm_pause(); }
#else
static inline void relax() {}
#endif

constexpr int NB = 64;

// The kernels' own threads. A decoding step calls the kernels ~250 times in a few milliseconds; an OpenMP region
// whose idle threads sleep (OMP_WAIT_POLICY=PASSIVE, what a shared CPU needs) costs tens of microseconds to wake
// each time, and one whose threads spin stalls for a whole time slice when another process holds a core. Here the
// calling thread and the workers claim the items of a call one at a time from a shared counter, so the caller never
// waits for a worker that has not started (on a busy machine it just does more of the items itself); workers spin
// for SPIN_US after a call (the next one usually comes sooner), then sleep. Which thread computes an item never
// changes its arithmetic.
class Pool {
 public:
  using Job = std::function<void(int64_t, int64_t)>;
  static constexpr int64_t SPIN_US = 200;
  static constexpr uint64_t ITEMS = (1u << 20) - 1;  // items a call may have (more run on the caller alone)
  static constexpr int64_t STRAGGLER_US = 20;
  static constexpr std::chrono::milliseconds BACKOFF_MIN{10};

  // fn(i, i + 1) for every i in [0, n), spread over the caller and up to torch's thread count - 1 workers. From a
  // second thread at once, or with one thread, the caller runs it all.
  void run(int64_t n, const Job& fn) {
    const int threads = std::min<int64_t>(n, at::get_num_threads());
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const auto start = std::chrono::steady_clock::now();
    if (threads <= 1 || !busy.owns_lock() || n > ITEMS || start < serial_until_) {
      fn(0, n);
      return;
    }
    State& s = state(threads - 1);
    s.job = &fn;
    s.done.store(0, std::memory_order_relaxed);
    const uint64_t generation = ((s.next.load(std::memory_order_relaxed) >> 40) + 1) & 0xffffff;
    // sequentially consistent, with the worker's two below: either it sees the new call or this sees it asleep
    s.next.store(generation << 40 | uint64_t(n) << 20);
    if (s.sleeping.load() > 0) {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.wake.notify_all();
    }
    const int64_t mine = claim(s, generation);
    const auto claimed = std::chrono::steady_clock::now();
    for (int64_t spins = 0; s.done.load(std::memory_order_acquire) < n; ++spins)
      if (spins > 4096) std::this_thread::yield(); else relax();
    // A worker that claimed an item and then lost its core (another process took it) makes the caller wait for a
    // time slice: much longer than an item takes. Then the calls run on the caller alone for a while (doubling while
    // it recurs, up to a second) before the workers are tried again.
    const auto now = std::chrono::steady_clock::now();
    const auto item = (claimed - start) / std::max<int64_t>(mine, 1);
    if (now - claimed > 2 * item + std::chrono::microseconds(STRAGGLER_US)) {
      backoff_ = std::min<std::chrono::nanoseconds>(std::max<std::chrono::nanoseconds>(2 * backoff_, BACKOFF_MIN),
                                                    std::chrono::seconds(1));
      serial_until_ = now + backoff_;
    } else {
      backoff_ = std::chrono::nanoseconds(0);
    }
  }

 private:
  struct State {
    // the call: its generation (24 bits), its number of items (20 bits) and its next unclaimed item (20 bits)
    std::atomic<uint64_t> next{0};
    std::atomic<int64_t> done{0};   // items finished
    std::atomic<int> sleeping{0};
    std::mutex mutex;
    std::condition_variable wake;
    const Job* job = nullptr;
    int workers = 0;
    pid_t pid = getpid();
  };

  // Items of call `generation` until none is left. An item below the call's count is claimed only while that call
  // is current, and the call cannot end before a claimed item is done, so `job` is that call's while it is read.
  // Returns how many it did.
  static int64_t claim(State& s, uint64_t generation) {
    int64_t did = 0;
    uint64_t next = s.next.load(std::memory_order_acquire);
    while ((next >> 40) == generation) {
      const int64_t item = int64_t(next & ITEMS), n = int64_t((next >> 20) & ITEMS);
      if (item >= n) break;
      if (!s.next.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel)) continue;
      (*s.job)(item, item + 1);
      ++did;
      s.done.fetch_add(1, std::memory_order_acq_rel);
      next = s.next.load(std::memory_order_acquire);
    }
    return did;
  }

  // the workers, made on first use (more when torch's thread count grows) and after a fork (a child has none of its
  // parent's threads: it starts afresh, leaving the parent's state behind)
  State& state(int want) {
    if (state_ == nullptr || state_->pid != getpid()) state_ = new State();
    while (state_->workers < want) {
      ++state_->workers;
      std::thread(work, state_).detach();
    }
    return *state_;
  }

  static void work(State* s) {
    uint64_t seen = s->next.load() >> 40;
    for (;;) {
      auto idle = std::chrono::steady_clock::now();
      uint64_t now;
      while ((now = s->next.load(std::memory_order_acquire) >> 40) == seen) {
        relax();
        if (std::chrono::steady_clock::now() - idle > std::chrono::microseconds(SPIN_US)) {
          std::unique_lock<std::mutex> lock(s->mutex);
          s->sleeping.fetch_add(1);
          s->wake.wait(lock, [&] { return (s->next.load() >> 40) != seen; });
          s->sleeping.fetch_sub(1);
          idle = std::chrono::steady_clock::now();
        }
      }
      seen = now;
      claim(*s, now);
    }
  }

  std::mutex busy_;
  State* state_ = nullptr;
  std::chrono::steady_clock::time_point serial_until_{};
  std::chrono::nanoseconds backoff_{0};
};

static Pool pool;

static inline float widen(float v) { return v; }
static inline float widen(uint16_t v) {  // bfloat16 -> float32: its bits are a float32's upper half
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// MR rows of x [.., K] times one column block [K, NB]: each output a fused multiply-add chain over k in order
#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32: shift each into a float's upper half
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int MR, typename W>
static void tile(const float* x, int64_t K, const W* block, float* out, int64_t N, int64_t col0) {
  const int64_t cols = std::min<int64_t>(NB, N - col0);
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = block + k * NB;
    const __m512 w0 = load16(wk), w1 = load16(wk + 16), w2 = load16(wk + 32), w3 = load16(wk + 48);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float row[NB];
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(row + 16 * v, acc[r][v]);
    std::memcpy(out + r * N + col0, row, cols * sizeof(float));
  }
}
#else
template <int MR, typename W>
static void tile(const float* x, int64_t K, const W* block, float* out, int64_t N, int64_t col0) {
  const int64_t cols = std::min<int64_t>(NB, N - col0);
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
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * N + col0, acc[r], cols * sizeof(float));
}
#endif

// bfloat16 rows times bfloat16 weights with the CPU's bf16 dot products (AVX512-BF16's vdpbf16ps: 32 products a
// vector where an fp32 fused multiply-add has 16, and no widening): the weight's block is laid out in pairs of k,
// [ceil(K / 2), NB, 2], and each output is a chain over the pairs in order, from zero, each pair's two products
// added into it by the instruction (its own fixed order and rounding, denormals flushed). The same chain for one row
// or six: rows stay independent of each other. An odd K's last pair is padded with a zero weight and a zero input.
#if defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;

template <int MR>
static void tile_pairs(const uint16_t* x, int64_t K, const uint16_t* block, float* out, int64_t N, int64_t col0) {
  const int64_t cols = std::min<int64_t>(NB, N - col0), pairs = (K + 1) / 2;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = block + p * 2 * NB;  // 16 columns' pairs a vector
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    const int64_t k = 2 * p;
    for (int r = 0; r < MR; ++r) {
      const uint16_t* xr = x + r * K;
      const uint32_t both = uint32_t(xr[k]) | (k + 1 < K ? uint32_t(xr[k + 1]) << 16 : 0u);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(both));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float row[NB];
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(row + 16 * v, acc[r][v]);
    std::memcpy(out + r * N + col0, row, cols * sizeof(float));
  }
}

static void run_pairs(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* out, int64_t N) {
  const int64_t blocks = (N + NB - 1) / NB, stride = (K + 1) / 2 * 2 * NB;
  pool.run(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* block = w + b * stride;
      for (int64_t m = 0; m < M; m += 6) {
        const uint16_t* xm = x + m * K;
        float* om = out + m * N;
        switch (std::min<int64_t>(6, M - m)) {
          case 6: tile_pairs<6>(xm, K, block, om, N, b * NB); break;
          case 5: tile_pairs<5>(xm, K, block, om, N, b * NB); break;
          case 4: tile_pairs<4>(xm, K, block, om, N, b * NB); break;
          case 3: tile_pairs<3>(xm, K, block, om, N, b * NB); break;
          case 2: tile_pairs<2>(xm, K, block, om, N, b * NB); break;
          default: tile_pairs<1>(xm, K, block, om, N, b * NB); break;
        }
      }
    }
  });
}
#else
constexpr bool BF16_PAIRS = false;

static void run_pairs(const uint16_t*, int64_t, int64_t, const uint16_t*, float*, int64_t) {
  TORCH_CHECK(false, "this build has no bf16 dot products");
}
#endif

bool bf16_pairs() { return BF16_PAIRS; }

template <typename W>
static void run(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N) {
  const int64_t blocks = (N + NB - 1) / NB;
  pool.run(blocks, [&](int64_t b0, int64_t b1) {
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

// x [M, K] float32, packed [blocks, K, NB] (float32, or bfloat16 bits as int16); or x [M, K] bfloat16 and packed
// [blocks, ceil(K / 2), NB, 2] bfloat16 bits as int16 (the pairs of a build with bf16 dot products)
static torch::Tensor gemm_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, n}, x.options().dtype(torch::kFloat32));
  if (packed.dim() == 4)
    run_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K,
              reinterpret_cast<const uint16_t*>(packed.data_ptr()), out.data_ptr<float>(), n);
  else if (packed.scalar_type() == torch::kFloat32)
    run<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), out.data_ptr<float>(), n);
  else
    run<uint16_t>(x.data_ptr<float>(), M, K, reinterpret_cast<uint16_t*>(packed.data_ptr()),
                  out.data_ptr<float>(), n);
  return out;
}

torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor packed, int64_t n) {
  pybind11::gil_scoped_release free_python;  // a server's other threads run meanwhile (no Python object is touched)
  return gemm_rows(x, packed, n);
}

// exp(x) for x <= 0 (a score minus its row's maximum) in operations that are exact in IEEE arithmetic (fused
// multiply-adds, products, sums, a rounding, an exponent's bits), so a loop of it gives the same bits whether the
// compiler vectorises it or not, and whatever lane an element lands in (a vector libm's exp need not agree with the
// scalar one). Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, within 2 ulp. Below
// -87.3 (where 2^n would be subnormal) it gives exp(-87.3), about 1e-38: nothing a softmax's sum can tell from 0.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = (std::fma(x, 1.44269504088896341f, 12582912.0f)) - 12582912.0f;  // round(x / ln2)
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Sixteen floats from a cache's 16-bit elements, besides the GEMM's float32 and bfloat16 ones (each conversion exact).
#if defined(__AVX512F__)
static inline __m512 load16(const c10::BFloat16* p) { return load16(reinterpret_cast<const uint16_t*>(p)); }
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// s[g * 16 + jj] = the chain fma(q[g * D + d], keys[d * 16 + jj], ...) over d = 0 .. D - 1 from 0, for G query rows
// and the 16 lanes jj: with AVX-512, four rows' chains at a time in four registers (independent chains hide the
// instruction's latency; past G the last row is repeated and dropped); elsewhere the plain loops (the compiler leaves
// them scalar). Each lane's arithmetic is the same fused multiply-adds either way.
static inline void dots16(const float* q, int64_t G, int64_t D, const float* keys, float* s) {
#if defined(__AVX512F__)
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* r0 = q + g0 * D;
    const float* r1 = q + std::min(g0 + 1, G - 1) * D;
    const float* r2 = q + std::min(g0 + 2, G - 1) * D;
    const float* r3 = q + std::min(g0 + 3, G - 1) * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 key = _mm512_loadu_ps(keys + d * 16);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(r0[d]), key, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(r1[d]), key, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(r2[d]), key, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(r3[d]), key, a3);
    }
    const __m512 got[4] = {a0, a1, a2, a3};
    for (int64_t i = 0; i < 4 && g0 + i < G; ++i) _mm512_storeu_ps(s + (g0 + i) * 16, got[i]);
  }
#else
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * 16;
    for (int jj = 0; jj < 16; ++jj) sg[jj] = 0.f;
    for (int64_t d = 0; d < D; ++d)
      for (int jj = 0; jj < 16; ++jj) sg[jj] = std::fma(q[g * D + d], keys[d * 16 + jj], sg[jj]);
  }
#endif
}

// acc[g * D + d] = the chain fma(p[g * width + j], v_j[d], ...) over j = 0 .. n - 1 from 0 (v_j = vh + slot[j] * D),
// for G weight rows: with AVX-512 (D a multiple of 16), sixteen elements of four rows' chains in four registers while
// the values go by (past G the last row is repeated and dropped); elsewhere the plain loops. The same fused
// multiply-adds either way.
template <typename T>
static inline void weighted_sum(const float* p, int64_t width, int64_t G, const T* vh, const int64_t* slot, int64_t n,
                                int64_t D, float* acc, float* row) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same<T, double>::value) if (D % 16 == 0) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* p0 = p + g0 * width;
      const float* p1 = p + std::min(g0 + 1, G - 1) * width;
      const float* p2 = p + std::min(g0 + 2, G - 1) * width;
      const float* p3 = p + std::min(g0 + 3, G - 1) * width;
      for (int64_t c = 0; c < D; c += 16) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; ++j) {
          const __m512 value = load16(vh + slot[j] * D + c);
          a0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), value, a0);
          a1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), value, a1);
          a2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[j]), value, a2);
          a3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[j]), value, a3);
        }
        const __m512 got[4] = {a0, a1, a2, a3};
        for (int64_t i = 0; i < 4 && g0 + i < G; ++i) _mm512_storeu_ps(acc + (g0 + i) * D + c, got[i]);
      }
    }
    return;
  }
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = vh + slot[j] * D;
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(vj[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float pj = p[g * width + j];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, row[d], a[d]);
    }
  }
}

constexpr int64_t RUN = 8;          // queries at most in a run that shares its key blocks (runs are the threads' items)
constexpr int64_t MIN_SHARED = 16;  // keys a query must share with the run's first to join it (one block)

// Attention of R queries, each over its own keys: slots [R, W] (the first counts[r] are query r's key slots in position
// order), k, v [Hkv, S, D] (float32, bfloat16 or float16), q [R, Hq, D] float32 (scaled), out [R, Hq, D] float32.
// Per (query, KV head): each score a fused multiply-add chain over d (16 keys at a time, one per vector lane), the max
// over the scores, exp_nonpositive of each minus it, then one chain over the keys in order for every output and one
// for the weights' sum. Consecutive queries whose key lists begin alike (a step's tokens of one row share its prefix)
// form a run, and each block of 16 shared keys is gathered into lanes once for the run, not once per query; which
// run a query is in changes nothing in its arithmetic.
template <typename T>
static void attend(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* counts, float* out,
                   int64_t R, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, int64_t W) {
  const int64_t G = Hq / Hkv;
  std::vector<int64_t> first{0}, shared;  // per run: its first query (then R), the keys all its queries share
  while (first.back() < R) {
    const int64_t r0 = first.back();
    int64_t end = r0 + 1, common = counts[r0];
    while (end < R && end - r0 < RUN) {
      int64_t same = 0;
      const int64_t limit = std::min(common, counts[end]);
      while (same < limit && slots[end * W + same] == slots[r0 * W + same]) ++same;
      if (same < MIN_SHARED) break;
      common = same;
      ++end;
    }
    shared.push_back(common);
    first.push_back(end);
  }
  const int64_t runs = static_cast<int64_t>(shared.size());
  pool.run(runs * Hkv, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, keys(16 * D), lanes(16 * G), acc(G * D), row(D), total(G);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t run = i / Hkv, h = i % Hkv, r0 = first[run], r1 = first[run + 1];
      const T* kh = k + h * S * D;
      const T* vh = v + h * S * D;
      int64_t width = 0;
      for (int64_t r = r0; r < r1; ++r) width = std::max(width, counts[r]);
      scores.assign((r1 - r0) * G * width, 0.f);  // [query of the run][g][key]
      auto gather = [&](const int64_t* slot, int64_t m) {  // m keys, transposed: [d][key], a vector lane per key
        for (int64_t jj = 0; jj < 16; ++jj)
          for (int64_t d = 0; d < D; ++d)
            keys[d * 16 + jj] = jj < m ? static_cast<float>(kh[slot[jj] * D + d]) : 0.f;
      };
      auto score = [&](int64_t r, int64_t j0, int64_t m) {  // query r's scores of the gathered keys j0 .. j0 + m - 1
        dots16(q + (r * Hq + h * G) * D, G, D, keys.data(), lanes.data());
        for (int64_t g = 0; g < G; ++g) {
          float* dst = scores.data() + ((r - r0) * G + g) * width + j0;
          for (int64_t jj = 0; jj < m; ++jj) dst[jj] = lanes[g * 16 + jj];
        }
      };
      int64_t j0 = 0;
      for (; j0 + 16 <= shared[run]; j0 += 16) {
        gather(slots + r0 * W + j0, 16);
        for (int64_t r = r0; r < r1; ++r) score(r, j0, 16);
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = j0; j < counts[r]; j += 16) {
          const int64_t m = std::min<int64_t>(16, counts[r] - j);
          gather(slots + r * W + j, m);
          score(r, j, m);
        }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = counts[r];
        const int64_t* slot = slots + r * W;
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + ((r - r0) * G + g) * width;
          float top = sg[0];
          for (int64_t j = 1; j < n; ++j) top = std::max(top, sg[j]);
          for (int64_t j = 0; j < n; ++j) sg[j] = exp_nonpositive(sg[j] - top);
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) sum += sg[j];
          total[g] = sum;
        }
        weighted_sum(scores.data() + (r - r0) * G * width, width, G, vh, slot, n, D, acc.data(), row.data());
        for (int64_t g = 0; g < G; ++g) {
          float* o = out + (r * Hq + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] / total[g];
        }
      }
    }
  });
}

static torch::Tensor attention_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& slots, const torch::Tensor& counts) {
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1), W = slots.size(1);
  auto out = torch::empty({R, Hq, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "chain_attention", [&] {
    attend<scalar_t>(q.data_ptr<float>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                     counts.data_ptr<int64_t>(), out.data_ptr<float>(), R, Hq, Hkv, S, D, W);
  });
  return out;
}

torch::Tensor chain_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                              torch::Tensor counts) {
  pybind11::gil_scoped_release free_python;
  return attention_rows(q, k, v, slots, counts);
}

// A packed weight's GEMM as gemm() runs it: the rows in bfloat16 for pairs, else in float32; the output float32.
static torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  return gemm_rows(x.to(packed.dim() == 4 ? torch::kBFloat16 : torch::kFloat32).contiguous(), packed, n);
}

// RMSNorm as models.blocks.RMSNorm computes it: normalised in float32, rounded to the model's dtype, times the weight.
static torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return weight * at::rms_norm(x.to(torch::kFloat32), {x.size(-1)}, c10::nullopt, eps).to(x.scalar_type());
}

// The decoder layers of a LLaMA model (no biases, no q/k norms) over a packed step in the batch-invariant mode, with
// the CPU kernels: the ATen ops models.blocks' forward runs in the same order on tensors of the same shapes and
// layouts (so the same bits: an element-wise kernel picks its vectorised or scalar loop by layout), without a return
// to Python between them. x [1, T, H] (the model's dtype); cos, sin [1, T, 1, D] in that dtype; weights: per layer,
// the input norm's weight, q/k/v packed side by side, o, the post-attention norm's weight, gate/up side by side, down;
// k_cache, v_cache [layers, Hkv, S, D]; write_slots [T] int64, where each token's key and value go; queries [R] int64,
// the tokens that attend (the rest are padding: their attention output is zero), key_slots [R, W] and counts [R]
// int64, each query's key slots in position order (`cpu_gemm.attention`'s). Returns x after the last layer.
torch::Tensor decoder_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> weights,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor write_slots,
                             torch::Tensor queries, torch::Tensor key_slots, torch::Tensor counts, int64_t heads,
                             int64_t kv_heads, int64_t intermediate, double eps) {
  pybind11::gil_scoped_release free_python;
  const auto dtype = x.scalar_type();
  const int64_t T = x.size(1), H = x.size(2), D = cos.size(-1), half = D / 2;
  const double scale = std::pow(static_cast<double>(D), -0.5);
  for (size_t layer = 0; layer * 6 < weights.size(); ++layer) {
    const torch::Tensor* w = &weights[layer * 6];
    // attention: q, k and v from one GEMM, each rounded to the dtype; RoPE on q and k together
    auto qkv = linear_rows(rms_norm(x, w[0], eps).reshape({-1, H}), w[1], (heads + 2 * kv_heads) * D)
                   .split({heads * D, kv_heads * D, kv_heads * D}, 1);
    auto q = qkv[0].to(dtype).reshape({1, T, heads * D}).view({1, T, heads, D});
    auto k = qkv[1].to(dtype).reshape({1, T, kv_heads * D}).view({1, T, kv_heads, D});
    auto v = qkv[2].to(dtype).reshape({1, T, kv_heads * D}).view({1, T, kv_heads, D}).transpose(1, 2);
    auto both = at::cat({q, k}, 2);
    auto rotated = at::cat({-both.slice(-1, half), both.slice(-1, 0, half)}, -1);
    auto qk = (both * cos + rotated * sin).split({heads, kv_heads}, 2);
    auto qt = qk[0].transpose(1, 2), kt = qk[1].transpose(1, 2);  // [1, H, T, D]
    k_cache[layer].index_copy_(1, write_slots, kt[0]);
    v_cache[layer].index_copy_(1, write_slots, v[0]);
    auto attended = at::zeros_like(qt);
    auto scaled = (qt[0].index_select(1, queries).transpose(0, 1).to(torch::kFloat32) * scale).contiguous();
    auto got = attention_rows(scaled, k_cache[layer], v_cache[layer], key_slots, counts).to(dtype);
    attended[0].index_copy_(1, queries, got.transpose(0, 1));
    auto o = linear_rows(attended.transpose(1, 2).reshape({1, T, heads * D}).reshape({-1, heads * D}), w[2], H);
    x = x + o.to(dtype).reshape({1, T, H});
    // MLP: gate and up from one GEMM, each rounded to the dtype
    auto gate_up = linear_rows(rms_norm(x, w[3], eps).reshape({-1, H}), w[4], 2 * intermediate)
                       .split({intermediate, intermediate}, 1);
    auto gate = gate_up[0].to(dtype).reshape({1, T, intermediate});
    auto up = gate_up[1].to(dtype).reshape({1, T, intermediate});
    auto down = linear_rows((at::silu(gate) * up).reshape({-1, intermediate}), w[5], H);
    x = x + down.to(dtype).reshape({1, T, H});
  }
  return x;
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


def pack(weight: torch.Tensor, widen: bool = False) -> Packed:
    """Lay a CPU weight [N, K] out for `gemm`: bfloat16 stays 16-bit (in pairs of k where the build has bf16 dot
    products, `pairs`, unless `widen`: the widening path's layout, for a comparison), every other dtype becomes
    float32. Call `available` first."""
    n, k = weight.shape
    w = weight.detach()
    w = w if w.dtype == torch.bfloat16 else w.float()
    pad = -n % COLUMNS
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    if w.dtype == torch.bfloat16 and pairs() and not widen:
        w = torch.cat([w, w.new_zeros(w.shape[0], 1)], dim=1) if k % 2 else w  # an odd K's last pair: a zero weight
        blocks = w.view(-1, COLUMNS, w.shape[1] // 2, 2).transpose(1, 2).contiguous()
        return Packed(blocks.view(torch.int16), n)
    blocks = w.view(-1, COLUMNS, k).transpose(1, 2).contiguous()
    return Packed(blocks.view(torch.int16) if blocks.dtype == torch.bfloat16 else blocks, n)


def pairs() -> bool:
    """Whether this machine's build multiplies bfloat16 weights with the CPU's bf16 dot products (AVX512-BF16): then
    `gemm` takes bfloat16 rows for them, and each output is a chain over pairs of k (each pair's two products added
    by the instruction) instead of one over k. Call `available` first."""
    return _module is not None and _module.bf16_pairs()


def available(build_dir: str | os.PathLike | None = None) -> bool:
    """Whether the kernel is compiled (compiling it into `build_dir` on the first call; a failure warns once)."""
    return _load(build_dir) is not None


def gemm(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x [M, K] (contiguous, on the CPU) times the packed weight: [M, N] float32. x is float32, or bfloat16 for a
    bfloat16 weight packed in pairs (`pairs`); rows of another dtype are converted (to bfloat16 for pairs, so give a
    bfloat16 model's rows: float32 ones would be rounded). Call `available` first."""
    dtype = torch.bfloat16 if packed.blocks.dim() == 4 else torch.float32
    return _module.rows_gemm(x.to(dtype).contiguous(), packed.blocks, packed.out_features)


STALE_LOCK_S = 600  # a build holds torch's lock file for about a minute; one this old was left by a killed process


def _drop_stale_lock(folder: Path) -> None:
    """torch's loader waits for its build folder's `lock` file forever: a process killed mid-build leaves one behind,
    and every later load would hang."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:  # none there, or gone meanwhile
        pass


def attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, slots: torch.Tensor,
              counts: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Each query over its own keys (`invariant_triton.invariant_attention`'s contract, on the CPU): q [R, Hq, D];
    k_all, v_all [Hkv, S, D] (any float dtype; rows contiguous); slots [R, width], query i's key slots in position
    order in its first counts[i] entries. Each score a fused multiply-add chain over D, the max over them, then one
    chain over the keys in order for each output and for the weights' sum: a query's output depends on its own keys
    alone. Returns [R, Hq, D] in q's dtype. Call `available` first."""
    dim = q.shape[-1]
    q32 = (q.float() * (dim ** -0.5 if scale is None else scale)).contiguous()
    out = _module.chain_attention(q32, k_all.contiguous(), v_all.contiguous(), slots.to(torch.int64).contiguous(),
                                  counts.to(torch.int64).contiguous())
    return out.to(q.dtype)


def decoder_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list[torch.Tensor],
                   k_cache: torch.Tensor, v_cache: torch.Tensor, write_slots: torch.Tensor, queries: torch.Tensor,
                   key_slots: torch.Tensor, counts: torch.Tensor, heads: int, kv_heads: int, intermediate: int,
                   eps: float) -> torch.Tensor:
    """A LLaMA model's decoder layers (no biases, no q/k norms) over one packed step of the batch-invariant mode, in
    one call: per layer the ATen ops of `models.blocks`' forward in the same order, with `gemm` and `attention`, so
    the same bits as running them from Python, without Python between the ~80 ops of a layer. x [1, T, H] in the
    model's dtype; cos, sin [1, T, 1, D] in that dtype; weights: six per layer (input norm weight, q/k/v packed side
    by side, o, post-attention norm weight, gate/up side by side, down; packed by `pack`); k_cache, v_cache [layers,
    Hkv, S, D], written at `write_slots` [T]; queries [R], the tokens that attend, each over its key slots [R, W] in
    position order (the first counts[r]; all three int64, as `attention` takes them). Returns x after the last layer.
    Call `available` first."""
    return _module.decoder_layers(x, cos, sin, weights, k_cache, v_cache, write_slots, queries, key_slots, counts,
                                  heads, kv_heads, intermediate, eps)


def cpu_tag() -> str:
    """A short hash of this CPU's model and flags: the build is for this CPU alone (-march=native), so a cache folder
    shared by machines keeps one build per kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        facts = "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        facts = platform.processor()
    return hashlib.sha256(facts.encode()).hexdigest()[:12]


BF16_DOT_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # /proc/cpuinfo's names: x86's two, then aarch64's


def bf16_dot_products(cpuinfo: str | None = None) -> str | None:
    """The CPU feature that gives this CPU bfloat16 dot products (AMX, AVX512-BF16, Arm's BF16), as /proc/cpuinfo
    names it, or None (none of them, or no /proc/cpuinfo): where a bfloat16 model is read at half fp32's bytes
    without paying for it in slow conversions. cpuinfo: that file's text (None: read it)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return next((flag for flag in BF16_DOT_FLAGS if flag in flags), None)


def build_name() -> str:
    """The build's name: this kind of CPU and the source's version (steps' measured costs are kept per build)."""
    return f"lookahead_rows_gemm_{cpu_tag()}_{hashlib.sha256(_SOURCE.encode()).hexdigest()[:8]}"


def _load(build_dir):
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                # one build, in its own folder, per kind of CPU and version of the source: installs of two versions
                # sharing a cache folder would otherwise rebuild it over each other at every load
                name = build_name()
                folder = None
                if build_dir is not None:
                    folder = Path(build_dir) / name
                    folder.mkdir(parents=True, exist_ok=True)
                    _drop_stale_lock(folder)
                    if not (folder / f"{name}.so").is_file():  # a long silence otherwise
                        print(f"lookahead: compiling the batch-invariant CPU GEMM for this machine into {folder} "
                              "(once; about a minute)", file=sys.stderr, flush=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _module = load_inline(name, cpp_sources=_SOURCE,
                                          functions=["rows_gemm", "chain_attention", "bf16_pairs", "decoder_layers"],
                                          extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                                          extra_ldflags=["-fopenmp"],
                                          build_directory=None if folder is None else str(folder), verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only folder: the slower row plans instead
                _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(f"lookahead: the CPU GEMM kernel could not be compiled ({_failed}); the batch-invariant "
                              "mode uses torch's GEMMs through verified row counts instead (slower)", stacklevel=3)
    return _module
