// The batch-invariant CPU kernels (lookahead.kernels.cpu_kernels builds this file first, the others after it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
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
    if (threads <= 1 || !busy.owns_lock() || n > int64_t(ITEMS) || start < serial_until_) {
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
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float32: shift each into a float's upper half
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// AVX2 has 16 vector registers: the block's 64 columns in passes of V vectors (8 columns each) with MR * V <= 12,
// so the accumulators, a weight vector and the broadcast inputs stay in registers: one pass for one row, two for 2
// or 3 rows (more rows go 3 at a time: four passes of 2 vectors measured slower than two tiles of 3). The passes take
// K in chunks of KC, whose weights the first pass brings into L1 for the other; between chunks the accumulators wait
// in `rows` (stored and loaded exactly). The same chains as above, so the same bits.
template <int MR, typename W>
static void tile(const float* x, int64_t K, const W* block, float* out, int64_t N, int64_t col0) {
  if constexpr (MR > 3) {
    tile<3>(x, K, block, out, N, col0);
    tile<MR - 3>(x + 3 * K, K, block, out + 3 * N, N, col0);
    return;
  }
  constexpr int V = MR == 1 ? 8 : 4;
  constexpr int64_t KC = 64;
  const int64_t cols = std::min<int64_t>(NB, N - col0);
  float rows[MR][NB] = {};
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int64_t c0 = 0; c0 < cols; c0 += 8 * V) {
      __m256 acc[MR][V];
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_loadu_ps(rows[r] + c0 + 8 * v);
      for (int64_t k = k0; k < k1; ++k) {
        const W* wk = block + k * NB + c0;
        __m256 xv[MR];
        for (int r = 0; r < MR; ++r) xv[r] = _mm256_set1_ps(x[r * K + k]);
        for (int v = 0; v < V; ++v) {
          const __m256 wv = load8(wk + 8 * v);
          for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(xv[r], wv, acc[r][v]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v) _mm256_storeu_ps(rows[r] + c0 + 8 * v, acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * N + col0, rows[r], cols * sizeof(float));
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

// x [M, K] float32 times a weight packed [blocks, K, NB] (float32, or bfloat16 bits as int16), or x [M, K]
// bfloat16 times one packed [blocks, ceil(K / 2), NB, 2] (bfloat16 bits as int16: the pairs of a build with bf16 dot
// products), into out [M, n] float32
static void gemm_into(const void* x, int64_t M, int64_t K, const torch::Tensor& packed, int64_t n, float* out) {
  if (packed.dim() == 4)
    run_pairs(static_cast<const uint16_t*>(x), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), out, n);
  else if (packed.scalar_type() == torch::kFloat32)
    run<float>(static_cast<const float*>(x), M, K, packed.data_ptr<float>(), out, n);
  else
    run<uint16_t>(static_cast<const float*>(x), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), out, n);
}

static torch::Tensor gemm_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  auto out = torch::empty({x.size(0), n}, x.options().dtype(torch::kFloat32));
  gemm_into(x.data_ptr(), x.size(0), x.size(1), packed, n, out.data_ptr<float>());
  return out;
}

torch::Tensor rows_gemm(torch::Tensor x, torch::Tensor packed, int64_t n) {
  pybind11::gil_scoped_release free_python;  // a server's other threads run meanwhile (no Python object is touched)
  return gemm_rows(x, packed, n);
}

// Give the memory freed since (weights released after packing) back to the system: glibc keeps freed blocks below
// its mmap threshold in its heap, resident
void give_back_freed() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// Each tensor's (identity, version counter, data address) as int64 [n, 3]: what says a kept copy of weights is stale
// (a parameter replaced, written in place, or its data swapped). One call for a model's few hundred weights, where
// reading them from Python costs about a microsecond a tensor.
torch::Tensor stamps(std::vector<torch::Tensor> tensors) {
  auto out = torch::empty({int64_t(tensors.size()), 3}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  for (const auto& t : tensors) {
    *o++ = reinterpret_cast<int64_t>(t.unsafeGetTensorImpl());
    *o++ = static_cast<int64_t>(t._version());
    *o++ = t.is_meta() ? 0 : reinterpret_cast<int64_t>(t.data_ptr());
  }
  return out;
}

// The mode's RMSNorm (models.invariant.InvariantOps.norm runs it for the layers run from Python): per row, the
// squares summed in float32 in 16 lanes (lane l takes k = l, l + 16, ... in order), the lanes added in order, then
// x * (1 / sqrt(sum / H + eps)) rounded to the dtype, times the weight (a product rounded to the dtype). A row's bits
// are its own. One loop over the row where ATen's rms_norm runs a dozen ops of ~5 us each.
template <typename T>
static void norm_rows_of(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * H;
    float lanes[16] = {};
    int64_t k0 = 0;
    for (; k0 + 16 <= H; k0 += 16)
      for (int l = 0; l < 16; ++l) {
        const float v = static_cast<float>(xr[k0 + l]);
        lanes[l] = lanes[l] + v * v;
      }
    for (int64_t k = k0; k < H; ++k) {
      const float v = static_cast<float>(xr[k]);
      lanes[k - k0] = lanes[k - k0] + v * v;
    }
    float total = 0.f;
    for (int l = 0; l < 16; ++l) total = total + lanes[l];
    const float inv = 1.f / std::sqrt(total / static_cast<float>(H) + eps);
    T* o = out + r * H;
    for (int64_t k = 0; k < H; ++k) {
      const T normed = static_cast<T>(static_cast<float>(xr[k]) * inv);
      o[k] = static_cast<T>(static_cast<float>(w[k]) * static_cast<float>(normed));
    }
  }
}

static torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto xc = x.contiguous();
  const auto wc = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(xc);
  const int64_t H = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_rows", [&] {
    norm_rows_of<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel() / H,
                           H, static_cast<float>(eps));
  });
  return out;
}

torch::Tensor norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  pybind11::gil_scoped_release free_python;
  return rms_norm(x, weight, eps);
}

// RoPE on q [T, Hq, D] and k [T, Hkv, D] (contiguous) by cos, sin [T, D], as models.rope.apply_rotary computes it
// (x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype, never fused): the same bits, in
// one loop instead of eight ops.
template <typename T>
static void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + (t * heads + h) * D;
      T* oh = out + (t * heads + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const T rot = d < half ? static_cast<T>(-static_cast<float>(xh[d + half])) : xh[d - half];
        const T a = static_cast<T>(static_cast<float>(xh[d]) * static_cast<float>(cos[t * D + d]));
        const T b = static_cast<T>(static_cast<float>(rot) * static_cast<float>(sin[t * D + d]));
        oh[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
      }
    }
}
