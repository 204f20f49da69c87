// GEMMs over GGUF-quantized weights that keep the batch-invariant contract: each output row's bits depend on its own
// input row and the weight alone, whatever rows are computed beside it and whichever thread computes it.
//
// Built after cpu_kernels.cpp in one translation unit (lookahead.kernels.cpu_kernels): it uses that file's thread pool.
//
// The arithmetic (lookahead.kernels.quant holds the same definition in numpy; the tests hold the two bitwise equal):
// - each input row is quantized on its own, in blocks of 32 along K: d = max|x| / 127, q = rint(x / d) (as
//   rint(x * (1 / d))), clamped to [-127, 127] (a block of zeros has d = 0 and q = 0);
// - each weight is an unsigned code c with a per-type affine map: "zero-point" types (Q8_0, Q4_0, Q5_0, Q6_K) have
//   w = d * s * (c - z), "min" types (Q4_1, Q5_1, Q4_K) have w = d * s * c - m * t (s, t a K-quant's sub-block
//   scale and min, 1 elsewhere; Q4_1's m is its stored min with t = -1);
// - per output and input block, in block order from zero: the integer sums (exact, so any order and any vector
//   width give them) then a few float32 products and sums, each rounded, never fused:
//     zero-point: acc = acc + (d * dx) * float(sum_sub s * (sum c * q - z * sum q))
//     min:        acc = acc + (d * dx) * float(s * sum c * q);  acc = acc - (m * dx) * float(t * sum q)
//   (Q4_1 and Q5_1 subtract their min times -1, so their m is stored negated: m * t * -1 = +m.)
// A row's arithmetic is the same in the AVX512-VNNI tiles (u8 x s8 dot products, 16 outputs a vector), the AVX2 ones
// (u8 x s8 pairs, then pairs of pairs, 8 outputs a vector) and the portable loops: each computes exactly the
// definition above.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace quant {

constexpr int64_t MAGIC = 0x4C4B485131;  // "1QHKL": a blob of lookahead.kernels.quant
constexpr int64_t COLS = 16;            // outputs per column group (a vector of int32 lanes)
constexpr int64_t BLOCK = 32;           // inputs per activation block
constexpr int MAX_ROWS = 4;             // rows sharing one unpacking of a block's codes
constexpr int64_t GROUPS = 4;           // column groups a thread takes at a time (a claim costs a shared counter)

// ggml's type ids
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// A packed weight (lookahead.kernels.quant.pack writes it): a header of 16 int64, then its regions, each at an
// offset the header gives, for column groups of 16 outputs g and input blocks j:
//   codes [G][J][256 + 64 * hb]: the low nibbles of quads t and t + 4 in byte 4 * col + b of vector t (t < 4), then
//     hb vectors of high bits (quad t's at bit hb * t of the (hb * t / 8)-th), for input 32 j + 4 t + b; with hb = 8
//     (Q8_0) whole bytes instead, [G][J][512], quad t's in vector t;
//   d [G][J / per][16] float16; m the same (min types); sc [G][J][subs][16] (int8 for Q6_K, uint8 for Q4_K);
//   mn [G][J][16] uint8 (Q4_K).
struct Blob {
  int64_t type, N, K, G, J, hb, zero, per, subs, code_bytes;
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
  const uint8_t* sc;
  const uint8_t* mn;
};

static Blob parse(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kByte && t.dim() == 1 && t.is_contiguous() && t.numel() >= 128,
              "a quantized weight must be a packed uint8 blob (lookahead.kernels.quant.pack)");
  const auto* h = reinterpret_cast<const int64_t*>(t.data_ptr());
  TORCH_CHECK(h[0] == MAGIC, "not a packed quantized weight (bad magic)");
  const auto* base = t.data_ptr<uint8_t>();
  const int64_t code_bytes = h[6] == 8 ? 512 : 256 + 64 * h[6];
  Blob b{h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], code_bytes, nullptr, nullptr, nullptr, nullptr, nullptr};
  b.codes = base + h[10];
  b.d = reinterpret_cast<const uint16_t*>(base + h[11]);
  b.m = h[12] ? reinterpret_cast<const uint16_t*>(base + h[12]) : nullptr;
  b.sc = h[13] ? base + h[13] : nullptr;
  b.mn = h[14] ? base + h[14] : nullptr;
  TORCH_CHECK(h[15] == t.numel(), "a packed quantized weight's size differs from its header's");
  return b;
}

static inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// The input rows, quantized: q [M][K] int8, dx [M][J], and each block's sums of q over its two halves [M][J][2].
struct Rows {
  int64_t M = 0, K = 0, J = 0;
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> sums;
};

static void quantize_rows(const float* x, int64_t M, int64_t K, Rows& r) {
  r.M = M, r.K = K, r.J = K / BLOCK;
  r.q.resize(M * K), r.dx.resize(M * r.J), r.sums.resize(M * r.J * 2);
  for (int64_t i = 0; i < M * r.J; ++i) {
    const float* xb = x + i * BLOCK;
    float amax = 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int8_t* qb = r.q.data() + i * BLOCK;
    int32_t half[2] = {0, 0};
    for (int64_t k = 0; k < BLOCK; ++k) {
      const float v = std::nearbyint(xb[k] * inv);
      qb[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      half[k / 16] += qb[k];
    }
    r.dx[i] = d;
    r.sums[2 * i] = half[0], r.sums[2 * i + 1] = half[1];
  }
}

// The code of input 32 j + 4 t + b of column c in a block's code bytes.
static inline int32_t code_at(const Blob& w, const uint8_t* cp, int64_t c, int64_t t, int64_t b) {
  if (w.hb == 8) return cp[64 * t + 4 * c + b];  // whole bytes (Q8_0)
  const uint8_t lo = cp[64 * (t % 4) + 4 * c + b];
  int32_t code = t < 4 ? (lo & 15) : (lo >> 4);
  if (w.hb) {
    const int64_t bit = w.hb * t;
    code |= ((cp[256 + 64 * (bit / 8) + 4 * c + b] >> (bit % 8)) & ((1 << w.hb) - 1)) << 4;
  }
  return code;
}

// The portable loops: rows [m0, m0 + rows) of column group g, into out (row stride ldo) at col0.
static void tile_scalar(const Blob& w, const Rows& x, int64_t m0, int64_t rows, int64_t g, float* out, int64_t ldo,
                        int64_t col0) {
  const bool zero_point = w.zero >= 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    float acc[COLS] = {};
    for (int64_t j = 0; j < w.J; ++j) {
      const uint8_t* cp = w.codes + (g * w.J + j) * w.code_bytes;
      const int8_t* xq = x.q.data() + m * x.K + j * BLOCK;
      const float dx = x.dx[m * x.J + j];
      const int32_t s0 = x.sums[2 * (m * x.J + j)], s1 = x.sums[2 * (m * x.J + j) + 1];
      const int64_t dj = (g * (w.J / w.per) + j / w.per) * COLS;
      for (int64_t c = 0; c < COLS; ++c) {
        int32_t dot[2] = {0, 0};
        for (int64_t t = 0; t < 8; ++t)
          for (int64_t b = 0; b < 4; ++b) dot[t / 4] += code_at(w, cp, c, t, b) * xq[4 * t + b];
        const float d = half_to_float(w.d[dj + c]);
        if (zero_point) {
          int32_t i;
          if (w.subs == 2) {
            const auto* sc = reinterpret_cast<const int8_t*>(w.sc) + (g * w.J + j) * 2 * COLS;
            i = sc[c] * (dot[0] - int32_t(w.zero) * s0) + sc[COLS + c] * (dot[1] - int32_t(w.zero) * s1);
          } else {
            i = dot[0] + dot[1] - int32_t(w.zero) * (s0 + s1);
          }
          acc[c] = acc[c] + (d * dx) * static_cast<float>(i);
        } else {
          const int32_t s = w.sc ? w.sc[(g * w.J + j) * COLS + c] : 1, t = w.mn ? w.mn[(g * w.J + j) * COLS + c] : 1;
          acc[c] = acc[c] + (d * dx) * static_cast<float>(s * (dot[0] + dot[1]));
          acc[c] = acc[c] - (half_to_float(w.m[dj + c]) * dx) * static_cast<float>(t * (s0 + s1));
        }
      }
    }
    std::memcpy(out + m * ldo + col0, acc, sizeof(float) * std::min<int64_t>(COLS, w.N - g * COLS));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

// The same arithmetic with AVX512-VNNI, for NC column groups side by side (32 outputs) and up to MAX_ROWS rows: quad
// by quad, each group's 16 x 4 codes are unpacked once and each row's 4 inputs broadcast once, for NC vpdpbusd (u8
// codes x s8 inputs); the rows' and groups' integer chains are independent, so they overlap in the pipeline. Then
// each row's float steps on 16 outputs at once.
template <int64_t TYPE, int ROWS, int NC>
static void tile_vnni(const Blob& w, const Rows& x, int64_t m0, int64_t g0, float* out, int64_t ldo, int64_t col0) {
  constexpr bool zero_point = TYPE == Q8_0 || TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q6_K;
  constexpr int hb = TYPE == Q8_0 ? 8 : TYPE == Q6_K ? 2 : (TYPE == Q5_0 || TYPE == Q5_1) ? 1 : 0;
  constexpr int32_t z = TYPE == Q8_0 ? 128 : TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : TYPE == Q6_K ? 32 : 0;
  constexpr int64_t per = (TYPE == Q4_K || TYPE == Q6_K) ? 8 : 1;
  const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(hb < 8 ? (1 << hb) - 1 : -1);
  __m512 acc[ROWS][NC];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < w.J; ++j) {
    const uint8_t* cp[NC];
    for (int c = 0; c < NC; ++c) cp[c] = w.codes + ((g0 + c) * w.J + j) * w.code_bytes;
    const int8_t* xq = x.q.data() + m0 * x.K + j * BLOCK;
    __m512i dot[ROWS][NC], first[ROWS][NC];  // first: Q6_K's first half, finished at the fourth quad
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
      for (int c = 0; c < NC; ++c) dot[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512i code[NC];
#pragma GCC unroll 2
      for (int c = 0; c < NC; ++c) {
        if constexpr (hb == 8) {  // whole bytes: nothing to unpack
          code[c] = _mm512_loadu_si512(cp[c] + 64 * t);
          continue;
        }
        const __m512i lo = _mm512_loadu_si512(cp[c] + 64 * (t % 4));
        code[c] = t < 4 ? _mm512_and_si512(lo, low) : _mm512_and_si512(_mm512_srli_epi16(lo, 4), low);
        if constexpr (hb > 0 && hb < 8) {
          const __m512i hi = _mm512_loadu_si512(cp[c] + 256 + 64 * ((hb * t) / 8));
          const __m512i bits = _mm512_and_si512(_mm512_srli_epi16(hi, (hb * t) % 8), high);
          code[c] = _mm512_or_si512(code[c], _mm512_slli_epi16(bits, 4));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        // four inputs broadcast straight from memory (a load, no shuffle port)
        const __m512i b = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + r * x.K + 4 * t));
#pragma GCC unroll 2
        for (int c = 0; c < NC; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], code[c], b);
      }
      if constexpr (TYPE == Q6_K) {
        if (t == 3) {
#pragma GCC unroll 8
          for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
            for (int c = 0; c < NC; ++c) {
              first[r][c] = dot[r][c];
              dot[r][c] = _mm512_setzero_si512();
            }
        }
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) {
      const int64_t g = g0 + c, dj = (g * (w.J / per) + j / per) * COLS;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + dj)));
      __m512 mv = _mm512_setzero_ps();
      __m512i sc0 = _mm512_setzero_si512(), sc1 = sc0, mn = sc0;
      if constexpr (!zero_point)
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + dj)));
      if constexpr (TYPE == Q6_K) {
        const auto* sc = reinterpret_cast<const int8_t*>(w.sc) + (g * w.J + j) * 2 * COLS;
        sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + COLS)));
      }
      if constexpr (TYPE == Q4_K) {
        sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (g * w.J + j) * COLS)));
        mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mn + (g * w.J + j) * COLS)));
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int64_t m = m0 + r;
        const __m512 dx = _mm512_set1_ps(x.dx[m * x.J + j]);
        const int32_t s0 = x.sums[2 * (m * x.J + j)], s1 = x.sums[2 * (m * x.J + j) + 1];
        __m512i i;
        if constexpr (TYPE == Q6_K) {
          i = _mm512_add_epi32(_mm512_mullo_epi32(sc0, _mm512_sub_epi32(first[r][c], _mm512_set1_epi32(z * s0))),
                               _mm512_mullo_epi32(sc1, _mm512_sub_epi32(dot[r][c], _mm512_set1_epi32(z * s1))));
        } else if constexpr (zero_point) {
          i = _mm512_sub_epi32(dot[r][c], _mm512_set1_epi32(z * (s0 + s1)));
        } else if constexpr (TYPE == Q4_K) {
          i = _mm512_mullo_epi32(sc0, dot[r][c]);
        } else {
          i = dot[r][c];
        }
        acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(i)));
        if constexpr (!zero_point) {
          const __m512i sums = _mm512_set1_epi32(s0 + s1);
          const __m512i ts = TYPE == Q4_K ? _mm512_mullo_epi32(mn, sums) : sums;
          acc[r][c] = _mm512_sub_ps(acc[r][c], _mm512_mul_ps(_mm512_mul_ps(mv, dx), _mm512_cvtepi32_ps(ts)));
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t cols = std::min<int64_t>(COLS, w.N - (g0 + c) * COLS);
    for (int r = 0; r < ROWS; ++r) {
      float row[COLS];
      _mm512_storeu_ps(row, acc[r][c]);
      std::memcpy(out + (m0 + r) * ldo + col0 + c * COLS, row, sizeof(float) * cols);
    }
  }
}

// Column groups [g0, g0 + groups) of every row: two groups at a time (one where a single one is left), MAX_ROWS rows.
template <int64_t TYPE, int NC>
static void rows_of(const Blob& w, const Rows& x, int64_t g0, float* out, int64_t ldo, int64_t col0) {
  for (int64_t m0 = 0; m0 < x.M; m0 += MAX_ROWS) {
    switch (std::min<int64_t>(MAX_ROWS, x.M - m0)) {
      case 4: tile_vnni<TYPE, 4, NC>(w, x, m0, g0, out, ldo, col0); break;
      case 3: tile_vnni<TYPE, 3, NC>(w, x, m0, g0, out, ldo, col0); break;
      case 2: tile_vnni<TYPE, 2, NC>(w, x, m0, g0, out, ldo, col0); break;
      default: tile_vnni<TYPE, 1, NC>(w, x, m0, g0, out, ldo, col0); break;
    }
  }
}

template <int64_t TYPE>
static void tiles_of(const Blob& w, const Rows& x, int64_t g0, int64_t groups, float* out, int64_t ldo, int64_t col0) {
  int64_t g = g0;
  for (; g + 2 <= g0 + groups; g += 2) rows_of<TYPE, 2>(w, x, g, out, ldo, col0 + (g - g0) * COLS);
  if (g < g0 + groups) rows_of<TYPE, 1>(w, x, g, out, ldo, col0 + (g - g0) * COLS);
}
constexpr const char* FAST_PATH = "AVX512-VNNI";
#elif defined(__AVX2__) && defined(__F16C__)
constexpr const char* FAST_PATH = "AVX2";

// The same arithmetic with AVX2 (no u8 x s8 dot product into int32: vpmaddubsw's pairs into int16, then vpmaddwd's
// into int32), one column group as two vectors of 8 outputs, up to MAX_ROWS rows. The pairs cannot saturate: codes of
// at most 6 bits times |q| <= 127 stay below 2 * 63 * 127 < 32767; Q8_0's 8-bit codes are recentred to signed weights
// c - 128 first (|c - 128| <= 128, and 2 * 128 * 127 < 32767), its sum of (c - 128) * q being the definition's
// sum c * q - 128 * sum q exactly. Then each row's float steps on 8 outputs at once, as the portable loops do them.
template <int64_t TYPE, int ROWS>
static void tile_avx2(const Blob& w, const Rows& x, int64_t m0, int64_t g, float* out, int64_t ldo, int64_t col0) {
  constexpr bool zero_point = TYPE == Q8_0 || TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q6_K;
  constexpr int hb = TYPE == Q8_0 ? 8 : TYPE == Q6_K ? 2 : (TYPE == Q5_0 || TYPE == Q5_1) ? 1 : 0;
  constexpr int32_t z = TYPE == Q8_0 ? 0 : TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : TYPE == Q6_K ? 32 : 0;
  constexpr int64_t per = (TYPE == Q4_K || TYPE == Q6_K) ? 8 : 1;
  const __m256i low = _mm256_set1_epi8(15), high = _mm256_set1_epi8(hb < 8 ? (1 << hb) - 1 : -1);
  const __m256i ones = _mm256_set1_epi16(1), centre = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < w.J; ++j) {
    const uint8_t* cp = w.codes + (g * w.J + j) * w.code_bytes;
    const int8_t* xq = x.q.data() + m0 * x.K + j * BLOCK;
    __m256i dot[ROWS][2], first[ROWS][2];  // first: Q6_K's first half, finished at the fourth quad
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256i code[2], sign[2];
      for (int h = 0; h < 2; ++h) {
        if constexpr (hb == 8) {  // whole bytes, recentred: |c - 128| as u8, its sign given to the inputs
          const __m256i signed_code = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * t + 32 * h)), centre);
          code[h] = _mm256_abs_epi8(signed_code);
          sign[h] = signed_code;
          continue;
        }
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * (t % 4) + 32 * h));
        code[h] = t < 4 ? _mm256_and_si256(lo, low) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), low);
        if constexpr (hb > 0 && hb < 8) {
          const __m256i hi =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 256 + 64 * ((hb * t) / 8) + 32 * h));
          const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(hi, (hb * t) % 8), high);
          code[h] = _mm256_or_si256(code[h], _mm256_slli_epi16(bits, 4));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * x.K + 4 * t, sizeof four);
        const __m256i b = _mm256_set1_epi32(four);
        for (int h = 0; h < 2; ++h) {
          const __m256i bh = hb == 8 ? _mm256_sign_epi8(b, sign[h]) : b;
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(code[h], bh), ones));
        }
      }
      if constexpr (TYPE == Q6_K) {
        if (t == 3) {
#pragma GCC unroll 8
          for (int r = 0; r < ROWS; ++r)
            for (int h = 0; h < 2; ++h) {
              first[r][h] = dot[r][h];
              dot[r][h] = _mm256_setzero_si256();
            }
        }
      }
    }
    const int64_t dj = (g * (w.J / per) + j / per) * COLS;
    for (int h = 0; h < 2; ++h) {
      const int64_t at = 8 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + dj + at)));
      __m256 mv = _mm256_setzero_ps();
      __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0, mn = sc0;
      if constexpr (!zero_point) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + dj + at)));
      if constexpr (TYPE == Q6_K) {
        const auto* sc = reinterpret_cast<const int8_t*>(w.sc) + (g * w.J + j) * 2 * COLS + at;
        sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
        sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + COLS)));
      }
      if constexpr (TYPE == Q4_K) {
        sc0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + (g * w.J + j) * COLS + at)));
        mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + (g * w.J + j) * COLS + at)));
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int64_t m = m0 + r;
        const __m256 dx = _mm256_set1_ps(x.dx[m * x.J + j]);
        const int32_t s0 = x.sums[2 * (m * x.J + j)], s1 = x.sums[2 * (m * x.J + j) + 1];
        __m256i i;
        if constexpr (TYPE == Q6_K) {
          i = _mm256_add_epi32(_mm256_mullo_epi32(sc0, _mm256_sub_epi32(first[r][h], _mm256_set1_epi32(z * s0))),
                               _mm256_mullo_epi32(sc1, _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(z * s1))));
        } else if constexpr (zero_point) {  // (Q8_0's z is 0 here: its dot is recentred already)
          i = _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(z * (s0 + s1)));
        } else if constexpr (TYPE == Q4_K) {
          i = _mm256_mullo_epi32(sc0, dot[r][h]);
        } else {
          i = dot[r][h];
        }
        acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(i)));
        if constexpr (!zero_point) {
          const __m256i sums = _mm256_set1_epi32(s0 + s1);
          const __m256i ts = TYPE == Q4_K ? _mm256_mullo_epi32(mn, sums) : sums;
          acc[r][h] = _mm256_sub_ps(acc[r][h], _mm256_mul_ps(_mm256_mul_ps(mv, dx), _mm256_cvtepi32_ps(ts)));
        }
      }
    }
  }
  const int64_t cols = std::min<int64_t>(COLS, w.N - g * COLS);
  for (int r = 0; r < ROWS; ++r) {
    float row[COLS];
    _mm256_storeu_ps(row, acc[r][0]);
    _mm256_storeu_ps(row + 8, acc[r][1]);
    std::memcpy(out + (m0 + r) * ldo + col0, row, sizeof(float) * cols);
  }
}

// Column groups [g0, g0 + groups) of every row, MAX_ROWS rows at a time.
template <int64_t TYPE>
static void tiles_of(const Blob& w, const Rows& x, int64_t g0, int64_t groups, float* out, int64_t ldo, int64_t col0) {
  for (int64_t g = g0; g < g0 + groups; ++g) {
    const int64_t at = col0 + (g - g0) * COLS;
    for (int64_t m0 = 0; m0 < x.M; m0 += MAX_ROWS) {
      switch (std::min<int64_t>(MAX_ROWS, x.M - m0)) {
        case 4: tile_avx2<TYPE, 4>(w, x, m0, g, out, ldo, at); break;
        case 3: tile_avx2<TYPE, 3>(w, x, m0, g, out, ldo, at); break;
        case 2: tile_avx2<TYPE, 2>(w, x, m0, g, out, ldo, at); break;
        default: tile_avx2<TYPE, 1>(w, x, m0, g, out, ldo, at); break;
      }
    }
  }
}
#else
constexpr const char* FAST_PATH = "portable";
#endif

// Column groups [g0, g0 + groups) of every row, by the build's fastest path (or the portable one where asked: the
// tests compare the two).
static void groups_of(const Blob& w, const Rows& x, int64_t g0, int64_t groups, float* out, int64_t ldo, int64_t col0,
                      bool portable) {
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__F16C__))
  if (!portable) {
    switch (w.type) {
      case Q8_0: return tiles_of<Q8_0>(w, x, g0, groups, out, ldo, col0);
      case Q4_0: return tiles_of<Q4_0>(w, x, g0, groups, out, ldo, col0);
      case Q4_1: return tiles_of<Q4_1>(w, x, g0, groups, out, ldo, col0);
      case Q5_0: return tiles_of<Q5_0>(w, x, g0, groups, out, ldo, col0);
      case Q5_1: return tiles_of<Q5_1>(w, x, g0, groups, out, ldo, col0);
      case Q4_K: return tiles_of<Q4_K>(w, x, g0, groups, out, ldo, col0);
      case Q6_K: return tiles_of<Q6_K>(w, x, g0, groups, out, ldo, col0);
      default: break;
    }
  }
#endif
  (void)portable;
  for (int64_t g = g0; g < g0 + groups; ++g) tile_scalar(w, x, 0, x.M, g, out, ldo, col0 + (g - g0) * COLS);
}

// x [M, K] float32 times the weights side by side (each segment's outputs after the previous ones'): [M, sum N].
static torch::Tensor rows(const torch::Tensor& x, const std::vector<torch::Tensor>& segments, bool portable) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be [M, K] float32");
  std::vector<Blob> blobs;
  std::vector<int64_t> first_col{0};
  std::vector<std::pair<int64_t, int64_t>> items;  // (segment, first column group): GROUPS groups a thread's item
  for (const auto& s : segments) {
    blobs.push_back(parse(s));
    TORCH_CHECK(blobs.back().K == x.size(1), "a quantized weight's K (", blobs.back().K, ") differs from x's (",
                x.size(1), ")");
    for (int64_t g = 0; g < blobs.back().G; g += GROUPS) items.emplace_back(int64_t(blobs.size()) - 1, g);
    first_col.push_back(first_col.back() + blobs.back().N);
  }
  const int64_t M = x.size(0), n = first_col.back();
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  Rows q;
  quantize_rows(x.data_ptr<float>(), M, x.size(1), q);
  float* o = out.data_ptr<float>();
  pool.run(int64_t(items.size()), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [s, g0] = items[i];
      groups_of(blobs[s], q, g0, std::min(GROUPS, blobs[s].G - g0), o, n, first_col[s] + g0 * COLS, portable);
    }
  });
  return out;
}

// Rows `ids` (count of them) of a packed weight dequantized to float32 into out [count, K]: an embedding's lookup
// (quant_rows, and cpu_kernels.decoder_step's first op for a GGUF model's quantized embedding).
static void rows_of(const torch::Tensor& blob, const int64_t* ids, int64_t count, float* out) {
  const Blob w = parse(blob);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids[i];
    TORCH_CHECK(n >= 0 && n < w.N, "row ", n, " is outside the weight's ", w.N, " rows");
    const int64_t g = n / COLS, c = n % COLS;
    for (int64_t j = 0; j < w.J; ++j) {
      const uint8_t* cp = w.codes + (g * w.J + j) * w.code_bytes;
      const int64_t dj = (g * (w.J / w.per) + j / w.per) * COLS;
      const float d = half_to_float(w.d[dj + c]);
      for (int64_t k = 0; k < BLOCK; ++k) {
        const int32_t code = code_at(w, cp, c, k / 4, k % 4);
        float v;
        if (w.zero >= 0) {
          const float s = w.sc ? static_cast<float>(reinterpret_cast<const int8_t*>(w.sc)[(g * w.J + j) * 2 * COLS +
                                                                                         (k / 16) * COLS + c])
                               : 1.f;
          v = w.sc ? (d * s) * static_cast<float>(code - w.zero) : d * static_cast<float>(code - w.zero);
        } else if (w.sc) {  // Q4_K: (d * sc) * c - dmin * mn
          const float s = w.sc[(g * w.J + j) * COLS + c], t = w.mn[(g * w.J + j) * COLS + c];
          v = (d * s) * static_cast<float>(code) - half_to_float(w.m[dj + c]) * t;
        } else {  // Q4_1, Q5_1: d * c + m (m stored negated)
          v = d * static_cast<float>(code) - half_to_float(w.m[dj + c]);
        }
        out[i * w.K + j * BLOCK + k] = v;
      }
    }
  }
}

}  // namespace quant

// A quantized linear's rows as decoder_step runs them: float32 in, float32 out.
torch::Tensor quant_gemm(torch::Tensor x, std::vector<torch::Tensor> segments, bool portable) {
  pybind11::gil_scoped_release free_python;
  return quant::rows(x, segments, portable);
}

std::string quant_path() { return quant::FAST_PATH; }

// Rows `ids` of a packed weight, dequantized to float32 as ggml does ([len(ids), K]): an embedding's lookup.
torch::Tensor quant_rows(torch::Tensor blob, torch::Tensor ids) {
  const auto id = ids.to(torch::kInt64).contiguous();
  auto out = torch::empty({id.numel(), quant::parse(blob).K}, torch::kFloat32);
  quant::rows_of(blob, id.data_ptr<int64_t>(), id.numel(), out.data_ptr<float>());
  return out;
}
