// The batch-invariant attention on the CPU (lookahead.kernels.cpu_kernels.attention, and the layers in one call):
// each query over its own keys in position order. Built after cpu_kernels.cpp in one translation unit (it uses that
// file's thread pool and loads).

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

// A cache row's lines asked of memory ahead of their use: a long context's keys and values come from memory, in the
// order of the key slots (which the hardware's prefetchers cannot guess), AHEAD keys before they are read.
constexpr int64_t AHEAD = 8;
template <typename T>
static inline void prefetch_row(const T* row, int64_t D) {
#if defined(__x86_64__)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
#endif
}

// Sixteen float lanes, for the loops below: AVX-512's one register, AVX2's two, else an array (each op
// the same IEEE operation per lane, so which one a build has never changes a bit).
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
static inline Lanes lanes_set1(float x) { return {_mm512_set1_ps(x)}; }
static inline Lanes lanes_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void lanes_store(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
static inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline Lanes operator/(Lanes a, Lanes b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline Lanes lanes_max(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
// a where j < limit (per lane), else b
static inline Lanes below(float j, Lanes limit, Lanes a, Lanes b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(j), limit.v, _CMP_LT_OQ), b.v, a.v)};
}
static inline Lanes exponent_bits(Lanes n) {  // 2^n for whole numbers n in [-126, 127]: n + 127 as the exponent's bits
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127)),
                                                23))};
}
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  __m256 lo, hi;
};
static inline Lanes lanes_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline Lanes lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void lanes_store(float* p, Lanes a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
static inline Lanes fma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline Lanes operator-(Lanes a, Lanes b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline Lanes operator/(Lanes a, Lanes b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline Lanes lanes_max(Lanes a, Lanes b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline Lanes below(float j, Lanes limit, Lanes a, Lanes b) {
  const __m256 jj = _mm256_set1_ps(j);
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(jj, limit.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(jj, limit.hi, _CMP_LT_OQ))};
}
static inline Lanes exponent_bits(Lanes n) {
  const __m256i bias = _mm256_set1_epi32(127);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.lo), bias), 23)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.hi), bias), 23))};
}
#else
struct Lanes {
  float x[16];
};
template <typename F>
static inline Lanes each(F f) {
  Lanes out;
  for (int l = 0; l < 16; ++l) out.x[l] = f(l);
  return out;
}
static inline Lanes lanes_set1(float x) { return each([&](int) { return x; }); }
static inline Lanes lanes_load(const float* p) { return each([&](int l) { return p[l]; }); }
static inline void lanes_store(float* p, Lanes a) { std::memcpy(p, a.x, sizeof a.x); }
static inline Lanes fma(Lanes a, Lanes b, Lanes c) {
  return each([&](int l) { return std::fma(a.x[l], b.x[l], c.x[l]); });
}
static inline Lanes operator+(Lanes a, Lanes b) { return each([&](int l) { return a.x[l] + b.x[l]; }); }
static inline Lanes operator-(Lanes a, Lanes b) { return each([&](int l) { return a.x[l] - b.x[l]; }); }
static inline Lanes operator*(Lanes a, Lanes b) { return each([&](int l) { return a.x[l] * b.x[l]; }); }
static inline Lanes operator/(Lanes a, Lanes b) { return each([&](int l) { return a.x[l] / b.x[l]; }); }
static inline Lanes lanes_max(Lanes a, Lanes b) { return each([&](int l) { return std::max(a.x[l], b.x[l]); }); }
static inline Lanes below(float j, Lanes limit, Lanes a, Lanes b) {
  return each([&](int l) { return j < limit.x[l] ? a.x[l] : b.x[l]; });
}
static inline Lanes exponent_bits(Lanes n) {
  return each([&](int l) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.x[l]) + 127) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}
#endif

// Sixteen of a cache's elements as floats, for any build (each conversion exact).
template <typename T>
static inline Lanes lanes_widen(const T* p) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same<T, float>::value) return {load16(p)};
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    const auto* bits = reinterpret_cast<const uint16_t*>(p);
    return {load8(bits), load8(bits + 8)};
  }
#if defined(__F16C__)
  if constexpr (std::is_same<T, c10::Half>::value) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1))};
  }
#endif
#endif
  if constexpr (std::is_same<T, float>::value) {
    return lanes_load(p);
  } else {
    float wide[16];
    for (int l = 0; l < 16; ++l) wide[l] = static_cast<float>(p[l]);
    return lanes_load(wide);
  }
}

// s[g * 16 + jj] = the chain fma(q[g * D + d], keys[d * 16 + jj], ...) over d = 0 .. D - 1 from 0, for G query rows
// and the 16 lanes jj: four rows' chains at a time (independent chains hide the instruction's latency; past G the last
// row is repeated and dropped), in AVX-512's one register per row, AVX2's two, or the portable loops' arrays: each
// lane's arithmetic the same fused multiply-adds.
static inline void dots16(const float* q, int64_t G, int64_t D, const float* keys, float* s) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* r0 = q + g0 * D;
    const float* r1 = q + std::min(g0 + 1, G - 1) * D;
    const float* r2 = q + std::min(g0 + 2, G - 1) * D;
    const float* r3 = q + std::min(g0 + 3, G - 1) * D;
    Lanes a0 = lanes_set1(0.f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const Lanes key = lanes_load(keys + d * 16);
      a0 = fma(lanes_set1(r0[d]), key, a0);
      a1 = fma(lanes_set1(r1[d]), key, a1);
      a2 = fma(lanes_set1(r2[d]), key, a2);
      a3 = fma(lanes_set1(r3[d]), key, a3);
    }
    const Lanes got[4] = {a0, a1, a2, a3};
    for (int64_t i = 0; i < 4 && g0 + i < G; ++i) lanes_store(s + (g0 + i) * 16, got[i]);
  }
}

// acc[g * D + d] = the chain fma(p[g * width + j], v_j[d], ...) over j = 0 .. n - 1 from 0 (v_j = vh + slot[j] * D),
// for G weight rows: where D is a multiple of 16, sixteen elements of four rows' chains in lanes while the values go
// by (past G the last row is repeated and dropped); elsewhere the plain loops. The same fused multiply-adds either
// way.
template <typename T>
static inline void weighted_sum(const float* p, int64_t width, int64_t G, const T* vh, const int64_t* slot, int64_t n,
                                int64_t D, float* acc, float* row) {
  if constexpr (!std::is_same<T, double>::value) if (D % 16 == 0) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* p0 = p + g0 * width;
      const float* p1 = p + std::min(g0 + 1, G - 1) * width;
      const float* p2 = p + std::min(g0 + 2, G - 1) * width;
      const float* p3 = p + std::min(g0 + 3, G - 1) * width;
      for (int64_t c = 0; c < D; c += 16) {
        Lanes a0 = lanes_set1(0.f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; ++j) {
          const Lanes value = lanes_widen(vh + slot[j] * D + c);
          a0 = fma(lanes_set1(p0[j]), value, a0);
          a1 = fma(lanes_set1(p1[j]), value, a1);
          a2 = fma(lanes_set1(p2[j]), value, a2);
          a3 = fma(lanes_set1(p3[j]), value, a3);
        }
        const Lanes got[4] = {a0, a1, a2, a3};
        for (int64_t i = 0; i < 4 && g0 + i < G; ++i) lanes_store(acc + (g0 + i) * D + c, got[i]);
      }
    }
    return;
  }
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

// exp_nonpositive in lanes: the same operations in the same order, so each lane's bits are the scalar one's (a lane
// where x is the maximum itself gives exp(+-0) = 1 either way, whichever zero a vector max picked).
static inline Lanes exp_nonpositive(Lanes x) {
  x = lanes_max(x, lanes_set1(-87.3f));
  const Lanes magic = lanes_set1(12582912.0f);
  const Lanes n = fma(x, lanes_set1(1.44269504088896341f), magic) - magic;
  Lanes r = fma(n, lanes_set1(-0.693359375f), x);
  r = fma(n, lanes_set1(2.12194440e-4f), r);
  Lanes p = lanes_set1(1.9875691500e-4f);
  p = fma(p, r, lanes_set1(1.3981999507e-3f));
  p = fma(p, r, lanes_set1(8.3334519073e-3f));
  p = fma(p, r, lanes_set1(4.1665795894e-2f));
  p = fma(p, r, lanes_set1(1.6666665459e-1f));
  p = fma(p, r, lanes_set1(5.0000001201e-1f));
  const Lanes y = fma(p, r * r, r) + lanes_set1(1.0f);
  return y * exponent_bits(n);
}

// accumulators the lanes' loops keep in registers (AVX-512's 32 registers hold 24 of them; AVX2's 16 of
// half the width hold 6 Lanes)
#if defined(__AVX512F__)
constexpr int ACCUMULATORS = 24;
#else
constexpr int ACCUMULATORS = 6;
#endif
constexpr int64_t RUN = 16;         // queries at most in a run that shares its keys (runs are the threads' items)
constexpr int64_t MIN_SHARED = 16;  // keys a query must share with the run's first to join it (one block)
constexpr int64_t LANE_ROWS = 6;    // a run of at least this many (query, head) rows puts its rows in lanes
constexpr int64_t KEY_TILE = 256;   // keys whose values stay in cache while every row of a run takes them
constexpr int64_t MAX_DV = 8;       // the lanes' loops: D at most 8 vectors of 16

// f(std::integral_constant<int, DV>{}) for the lanes' loops' DV (D / 16) in 1 .. MAX_DV: a template argument from a
// run-time D, in one place for every loop that takes it
template <typename F>
static void with_dv(int64_t dv, F&& f) {
  switch (dv) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
  }
  TORCH_CHECK(false, "the lanes' loops take D = 16 .. ", 16 * MAX_DV, " in steps of 16, not D = ", 16 * dv);
}

// A thread's buffers, kept between its items.
struct Scratch {
  std::vector<float> scores, keys, lanes, acc, row, total, qt, limit, top;
};

#if defined(__AVX512F__)
// r[i] = column i of the 16 x 16 matrix whose rows were r[0 .. 15] (pairs unpacked, then pairs of pairs, then the
// 128-bit quarters moved across the four vectors holding each column's parts).
static inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 16; i += 4) {  // u[i + m], quarter L: column 4 L + m of rows i .. i + 3
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Eight of a cache's elements as floats (each conversion exact).
template <typename T>
static inline __m256 widen8(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return load8(reinterpret_cast<const uint16_t*>(p));
  } else {
    float wide[8];
    for (int l = 0; l < 8; ++l) wide[l] = static_cast<float>(p[l]);
    return _mm256_loadu_ps(wide);
  }
}

// rows[i][j] <- rows[j][i]: an 8 x 8 block of floats transposed in registers.
static inline void transpose8(__m256* rows) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    rows[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// keys[d * 16 + jj] = element d of key jj, for m <= 16 keys of `slot` (zeros past m): the keys transposed, a vector
// lane per key. With AVX-512 and 16 keys, their rows 16 elements at a time, transposed in registers (with AVX2, 8 by
// 8), the next block's rows prefetched (`ahead`: the keys `slot` holds after these m).
template <typename T>
static void gather_keys(const T* kh, const int64_t* slot, int64_t m, int64_t D, float* keys, int64_t ahead = 0) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same<T, double>::value) {
    if (m == 16 && D % 16 == 0) {
      for (int64_t jj = 16; jj < std::min<int64_t>(32, 16 + ahead); ++jj) prefetch_row(kh + slot[jj] * D, D);
      for (int64_t c = 0; c < D; c += 16) {
        __m512 rows[16];
        for (int jj = 0; jj < 16; ++jj) rows[jj] = lanes_widen(kh + slot[jj] * D + c).v;
        transpose16(rows);
        for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps(keys + (c + dd) * 16, rows[dd]);
      }
      return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same<T, double>::value) {
    if (m == 16 && D % 8 == 0) {  // each half of the keys 8 by 8, transposed in registers
      for (int64_t jj = 16; jj < std::min<int64_t>(32, 16 + ahead); ++jj) prefetch_row(kh + slot[jj] * D, D);
      for (int64_t c = 0; c < D; c += 8)
        for (int half = 0; half < 2; ++half) {
          __m256 rows[8];
          for (int jj = 0; jj < 8; ++jj) rows[jj] = widen8(kh + slot[8 * half + jj] * D + c);
          transpose8(rows);
          for (int dd = 0; dd < 8; ++dd) _mm256_storeu_ps(keys + (c + dd) * 16 + 8 * half, rows[dd]);
        }
      return;
    }
  }
#endif
  for (int64_t jj = 0; jj < 16; ++jj)
    for (int64_t d = 0; d < D; ++d) keys[d * 16 + jj] = jj < m ? static_cast<float>(kh[slot[jj] * D + d]) : 0.f;
}

// Per row of `rows` rows of n scores (row g at scores + g * width): the max, each score's exp_nonpositive of it minus
// the max in place (16 at a time in lanes), and their sum into total[g], a chain over the scores in order (four rows'
// chains side by side, past `rows` the last repeated and dropped).
static void softmax_rows(float* scores, int64_t width, int64_t rows, int64_t n, float* total) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * width;
    Lanes most = lanes_set1(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) most = lanes_max(most, lanes_load(sg + j));
    float lanes[16];
    lanes_store(lanes, most);
    float top = -INFINITY;
    for (float x : lanes) top = std::max(top, x);
    for (; j < n; ++j) top = std::max(top, sg[j]);
    const Lanes tops = lanes_set1(top);
    for (j = 0; j + 16 <= n; j += 16) lanes_store(sg + j, exp_nonpositive(lanes_load(sg + j) - tops));
    for (; j < n; ++j) sg[j] = exp_nonpositive(sg[j] - top);
  }
  for (int64_t g0 = 0; g0 < rows; g0 += 4) {
    const float* p[4];
    for (int64_t i = 0; i < 4; ++i) p[i] = scores + std::min(g0 + i, rows - 1) * width;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < 4; ++i) sum[i] += p[i][j];
    for (int64_t i = 0; i < 4 && g0 + i < rows; ++i) total[g0 + i] = sum[i];
  }
}

// acc[i * D ..] += the chain fma(p_j[i], v_j, ...) over the keys j0 .. j1 - 1 of `slot` (p_j[i] = p[j * key_stride +
// i * row_stride]) for the rows i0 .. i1 - 1 (D = 16 * DV): RG rows at a time in registers, each key's value read
// once for them, whole (past i1 the last row is repeated and dropped).
template <typename T, int DV, int64_t RG = std::max(1, ACCUMULATORS / DV)>
static void lane_values(const float* p, int64_t key_stride, int64_t row_stride, int64_t i0, int64_t i1, const T* vh,
                        const int64_t* slot, int64_t j0, int64_t j1, float* acc) {
  constexpr int64_t D = 16 * DV;
  for (int64_t g0 = i0; g0 < i1; g0 += RG) {
    const float* row[RG];
    int64_t own[RG];
    for (int64_t t = 0; t < RG; ++t) own[t] = std::min(g0 + t, i1 - 1), row[t] = p + own[t] * row_stride;
    Lanes a[RG][DV];
    for (int64_t t = 0; t < RG; ++t)
      for (int c = 0; c < DV; ++c) a[t][c] = lanes_load(acc + own[t] * D + c * 16);
    for (int64_t j = j0; j < j1; ++j) {
      const T* value = vh + slot[j] * D;
      if (j + AHEAD < j1) prefetch_row(vh + slot[j + AHEAD] * D, D);
      Lanes vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = lanes_widen(value + c * 16);
      for (int64_t t = 0; t < RG; ++t) {
        const Lanes pj = lanes_set1(row[t][j * key_stride]);
        for (int c = 0; c < DV; ++c) a[t][c] = fma(pj, vv[c], a[t][c]);
      }
    }
    for (int64_t t = 0; t < RG && g0 + t < i1; ++t)
      for (int c = 0; c < DV; ++c) lanes_store(acc + (g0 + t) * D + c * 16, a[t][c]);
  }
}

// Whether keys of D elements of type T take the lanes' loops (lane_values, rows_in_lanes).
template <typename T>
static bool lanes_take(int64_t D) {
  return !std::is_same<T, double>::value && D % 16 == 0 && D / 16 <= MAX_DV;
}

// weighted_sum's chains (p [G, width]: acc [G, D] over the first n keys of `slot`), by lane_values where the lanes
// take the keys: each value read once, row by row of the cache, for every row (weighted_sum reads a row 16 elements
// at a time, a pass over the cache per 16: slower at long contexts, where the reads miss the cache).
template <typename T>
static void weighted_sums(const float* p, int64_t width, int64_t G, const T* vh, const int64_t* slot, int64_t n,
                          int64_t D, float* acc, float* row) {
  if constexpr (!std::is_same<T, double>::value) {
    if (lanes_take<T>(D)) {
      std::fill(acc, acc + G * D, 0.f);
      return with_dv(D / 16, [&](auto dv) {
        lane_values<T, decltype(dv)::value>(p, 1, width, 0, G, vh, slot, 0, n, acc);
      });
    }
  }
  weighted_sum(p, width, G, vh, slot, n, D, acc, row);
}

// One run (queries r0 .. r1 - 1, KV head h) with each query's keys in vector lanes: per block of 16 shared keys,
// gathered once for the run (gather_keys), every query's G rows of scores (dots16); then per query its rows' max, exps
// and sums (softmax_rows) and weighted sums (weighted_sums). For runs of few rows (a decoding step).
template <typename T>
static void keys_in_lanes(const float* q, const T* kh, const T* vh, const int64_t* slots, const int64_t* counts,
                          float* out, int64_t r0, int64_t r1, int64_t h, int64_t Hq, int64_t G, int64_t D, int64_t W,
                          int64_t shared, Scratch& s) {
  int64_t width = 0;
  for (int64_t r = r0; r < r1; ++r) width = std::max(width, counts[r]);
  s.keys.resize(16 * D), s.lanes.resize(16 * G), s.acc.resize(G * D), s.row.resize(D), s.total.resize(G);
  s.scores.assign((r1 - r0) * G * width, 0.f);  // [query of the run][g][key]
  auto gather = [&](const int64_t* slot, int64_t m, int64_t ahead) {
    gather_keys(kh, slot, m, D, s.keys.data(), ahead);
  };
  auto score = [&](int64_t r, int64_t j0, int64_t m) {  // query r's scores of the gathered keys j0 .. j0 + m - 1
    dots16(q + (r * Hq + h * G) * D, G, D, s.keys.data(), s.lanes.data());
    for (int64_t g = 0; g < G; ++g) {
      float* dst = s.scores.data() + ((r - r0) * G + g) * width + j0;
      for (int64_t jj = 0; jj < m; ++jj) dst[jj] = s.lanes[g * 16 + jj];
    }
  };
  int64_t j0 = 0;
  for (; j0 + 16 <= shared; j0 += 16) {
    gather(slots + r0 * W + j0, 16, shared - j0 - 16);
    for (int64_t r = r0; r < r1; ++r) score(r, j0, 16);
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = j0; j < counts[r]; j += 16) {
      const int64_t m = std::min<int64_t>(16, counts[r] - j);
      gather(slots + r * W + j, m, 0);
      score(r, j, m);
    }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = counts[r];
    const int64_t* slot = slots + r * W;
    softmax_rows(s.scores.data() + (r - r0) * G * width, width, G, n, s.total.data());
    weighted_sums(s.scores.data() + (r - r0) * G * width, width, G, vh, slot, n, D, s.acc.data(), s.row.data());
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + (r * Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = s.acc[g * D + d] / s.total[g];
    }
  }
}

// scores[j * RW + lane] = the chain fma(qt[d * RW + lane], key_j[d], ...) over d from 0, for the keys j0 .. j1 - 1 of
// `slot` and the lanes of RV vectors from v0 (RV <= 4): several keys at a time, each key's element broadcast to every
// lane (no gather); `top` takes each lane's maximum.
template <typename T, int RV>
static void lane_scores(const float* qt, int64_t RW, int64_t v0, int64_t D, const T* kh, const int64_t* slot,
                        int64_t j0, int64_t j1, float* scores, Lanes* top) {
  constexpr int KP = std::max(1, ACCUMULATORS * 2 / 3 / RV);
  int64_t j = j0;
  for (; j + KP <= j1; j += KP) {
    const T* key[KP];
    for (int t = 0; t < KP; ++t) key[t] = kh + slot[j + t] * D;
    Lanes acc[KP][RV];
    for (int t = 0; t < KP; ++t)
      for (int c = 0; c < RV; ++c) acc[t][c] = lanes_set1(0.f);
    for (int64_t d = 0; d < D; ++d) {
      Lanes qv[RV];
      for (int c = 0; c < RV; ++c) qv[c] = lanes_load(qt + d * RW + (v0 + c) * 16);
      for (int t = 0; t < KP; ++t) {
        const Lanes kv = lanes_set1(static_cast<float>(key[t][d]));
        for (int c = 0; c < RV; ++c) acc[t][c] = fma(qv[c], kv, acc[t][c]);
      }
    }
    for (int t = 0; t < KP; ++t)
      for (int c = 0; c < RV; ++c) {
        lanes_store(scores + (j + t) * RW + (v0 + c) * 16, acc[t][c]);
        top[c] = lanes_max(top[c], acc[t][c]);
      }
  }
  for (; j < j1; ++j) {
    const T* key = kh + slot[j] * D;
    for (int c = 0; c < RV; ++c) {
      Lanes acc = lanes_set1(0.f);
      for (int64_t d = 0; d < D; ++d)
        acc = fma(lanes_load(qt + d * RW + (v0 + c) * 16), lanes_set1(static_cast<float>(key[d])), acc);
      lanes_store(scores + j * RW + (v0 + c) * 16, acc);
      top[c] = lanes_max(top[c], acc);
    }
  }
}

// exp(score - the lane's max) for the keys j0 .. j1 - 1, in place, each added to its lane's sum where the key is one
// of the lane's (j < limit): the sum's chain over the keys in order, as keys_in_lanes adds them.
static void lane_exps(float* scores, int64_t RW, int64_t j0, int64_t j1, const float* top, const float* limit,
                      float* total) {
  for (int64_t v = 0; v < RW / 16; ++v) {
    const Lanes t = lanes_load(top + v * 16), lim = lanes_load(limit + v * 16), zero = lanes_set1(0.f);
    Lanes sum = lanes_load(total + v * 16);
    for (int64_t j = j0; j < j1; ++j) {
      float* sj = scores + j * RW + v * 16;
      const Lanes e = exp_nonpositive(lanes_load(sj) - t);
      lanes_store(sj, e);
      sum = sum + below(static_cast<float>(j), lim, e, zero);  // + 0: the same bits as stopping (a sum is > 0)
    }
    lanes_store(total + v * 16, sum);
  }
}

// One run (queries r0 .. r1 - 1, KV head h) with its (query, head) rows in vector lanes, for runs of many rows (a
// prompt chunk's, a lookahead step's): each score the same chain as keys_in_lanes computes, with the run's queries'
// rows side by side in lanes and each shared key's element broadcast (no gather); a query's own keys past the shared
// ones gathered as keys_in_lanes does; the max; then tile by tile of KEY_TILE keys the exps, the sums and the weighted
// sums, every row's chain in key order, the tile's values read from cache by every row. The same bits as
// keys_in_lanes, faster wherever a run has more than a few rows.
template <typename T, int DV>
static void rows_in_lanes(const float* q, const T* kh, const T* vh, const int64_t* slots, const int64_t* counts,
                          float* out, int64_t r0, int64_t r1, int64_t h, int64_t Hq, int64_t G, int64_t W,
                          int64_t shared, Scratch& s) {
  constexpr int64_t D = 16 * DV;
  const int64_t rows = (r1 - r0) * G, RW = (rows + 15) / 16 * 16;
  int64_t width = 0;
  for (int64_t r = r0; r < r1; ++r) width = std::max(width, counts[r]);
  s.qt.assign(D * RW, 0.f), s.limit.assign(RW, 0.f), s.top.resize(RW), s.total.assign(RW, 0.f);
  s.scores.resize(width * RW), s.acc.assign(RW * D, 0.f), s.keys.resize(16 * D), s.lanes.resize(16 * G);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i / G;
    const float* qi = q + (r * Hq + h * G + i % G) * D;
    for (int64_t d = 0; d < D; ++d) s.qt[d * RW + i] = qi[d];
    s.limit[i] = static_cast<float>(counts[r]);
  }
  // the scores of the shared keys, then each query's own (zeros where a lane has no key j: never read)
  const int64_t* slot0 = slots + r0 * W;
  for (int64_t v0 = 0; v0 < RW / 16; v0 += 4) {
    const int64_t rv = std::min<int64_t>(4, RW / 16 - v0);
    Lanes top[4];
    for (int c = 0; c < 4; ++c) top[c] = lanes_set1(-INFINITY);
    switch (rv) {
      case 1: lane_scores<T, 1>(s.qt.data(), RW, v0, D, kh, slot0, 0, shared, s.scores.data(), top); break;
      case 2: lane_scores<T, 2>(s.qt.data(), RW, v0, D, kh, slot0, 0, shared, s.scores.data(), top); break;
      case 3: lane_scores<T, 3>(s.qt.data(), RW, v0, D, kh, slot0, 0, shared, s.scores.data(), top); break;
      default: lane_scores<T, 4>(s.qt.data(), RW, v0, D, kh, slot0, 0, shared, s.scores.data(), top); break;
    }
    for (int64_t c = 0; c < rv; ++c) lanes_store(s.top.data() + (v0 + c) * 16, top[c]);
  }
  std::fill(s.scores.begin() + shared * RW, s.scores.end(), 0.f);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = shared; j < counts[r]; j += 16) {
      const int64_t m = std::min<int64_t>(16, counts[r] - j);
      const int64_t* slot = slots + r * W + j;
      gather_keys(kh, slot, m, D, s.keys.data());
      dots16(q + (r * Hq + h * G) * D, G, D, s.keys.data(), s.lanes.data());
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (r - r0) * G + g;
        for (int64_t jj = 0; jj < m; ++jj) {
          s.scores[(j + jj) * RW + i] = s.lanes[g * 16 + jj];
          s.top[i] = std::max(s.top[i], s.lanes[g * 16 + jj]);
        }
      }
    }
  // tile by tile of the shared keys, then each query's own keys
  for (int64_t j0 = 0; j0 < shared; j0 += KEY_TILE) {
    const int64_t j1 = std::min(shared, j0 + KEY_TILE);
    lane_exps(s.scores.data(), RW, j0, j1, s.top.data(), s.limit.data(), s.total.data());
    lane_values<T, DV>(s.scores.data(), RW, 1, 0, rows, vh, slot0, j0, j1, s.acc.data());
  }
  lane_exps(s.scores.data(), RW, shared, width, s.top.data(), s.limit.data(), s.total.data());
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i / G;
    lane_values<T, DV, 1>(s.scores.data(), RW, 1, i, i + 1, vh, slots + r * W, shared, counts[r], s.acc.data());
    float* o = out + (r * Hq + h * G + i % G) * D;
    const Lanes total = lanes_set1(s.total[i]);
    for (int c = 0; c < DV; ++c) lanes_store(o + c * 16, lanes_load(s.acc.data() + i * D + c * 16) / total);
  }
}

// Whether a run of `rows` (query, head) rows over keys of D elements of type T takes rows_in_lanes.
template <typename T>
static bool takes_rows_in_lanes(int64_t rows, int64_t D) {
  return rows >= LANE_ROWS && lanes_take<T>(D);
}

// Attention of R queries, each over its own keys: slots [R, W] (the first counts[r] are query r's key slots in position
// order), k, v [Hkv, S, D] (float32, bfloat16 or float16), q [R, Hq, D] float32 (scaled), out [R, Hq, D] float32.
// Per (query, query head): each score a fused multiply-add chain over d, the max over the scores, exp_nonpositive of
// each minus it, then one chain over the keys in order for every output and one for the weights' sum. Consecutive
// queries whose key lists begin alike (a step's tokens of one row share its prefix) form a run, which reads each
// shared key once (keys_in_lanes for runs of few rows, rows_in_lanes for more: the same arithmetic); which run a
// query is in, and which of the two takes it, changes nothing in its bits.
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
    static thread_local Scratch scratch;  // (the pool calls this once per item: the buffers outlive the calls)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t run = i / Hkv, h = i % Hkv, r0 = first[run], r1 = first[run + 1];
      const T* kh = k + h * S * D;
      const T* vh = v + h * S * D;
      if constexpr (!std::is_same<T, double>::value) {  // (double keys never take the lanes' loops)
        if (takes_rows_in_lanes<T>((r1 - r0) * G, D)) {
          with_dv(D / 16, [&](auto dv) {
            rows_in_lanes<T, decltype(dv)::value>(q, kh, vh, slots, counts, out, r0, r1, h, Hq, G, W, shared[run],
                                                  scratch);
          });
          continue;
        }
      }
      keys_in_lanes<T>(q, kh, vh, slots, counts, out, r0, r1, h, Hq, G, D, W, shared[run], scratch);
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

