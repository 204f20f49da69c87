// A packed step from its token ids to its logits in one call (lookahead.kernels.cpu_kernels.decoder_step), and the
// mode's SiLU: built last in the one translation unit (it uses cpu_kernels.cpp's GEMM, norm and RoPE,
// chain_attention.cpp's attention and lanes, quant_gemm.cpp's quantized rows). Between the GEMMs and the attention
// every op is a loop over raw buffers made once per call, so a decoding step runs no ATen op from its embedding to
// its logits: each op once cost a few microseconds of dispatch and allocation, about a dozen a layer and a dozen
// around the layers, where a small model's layer reads its weights in a few hundred.

// SiLU in lanes: e = exp(-|g|) <= 1 (no overflow for either sign), then g / (1 + e) for g > 0 and g * e / (1 + e)
// otherwise: both are g / (1 + exp(-g)). Within a few ulp of torch's (its vector exp is another polynomial); each
// lane's bits are the scalar build's, as every op is one IEEE operation per lane.
static inline Lanes silu(Lanes g) {
  const Lanes zero = lanes_set1(0.f), one = lanes_set1(1.f);
  const Lanes e = exp_nonpositive(zero - lanes_max(g, zero - g));
  const Lanes denominator = one + e;
  return below(0.f, g, g / denominator, (g * e) / denominator);
}

// float32 -> the dtype -> float32 (identity for float32): what an ATen op's output rounded to the dtype holds
template <typename T>
static inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out[i] = silu(gate[i]) * up[i] for i < n, as `F.silu(gate) * up` computes it on tensors of the dtype T: gate and
// up rounded to T (the GEMM's float32 outputs, or T already), the SiLU rounded to T, the product rounded to T.
template <typename T, typename In>
static void silu_mul_row(const In* gate, const In* up, T* out, int64_t n) {
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t width = std::min<int64_t>(16, n - i0);
    float g[16] = {}, u[16] = {}, s[16];
    for (int64_t l = 0; l < width; ++l) {
      g[l] = rounded<T>(static_cast<float>(gate[i0 + l]));
      u[l] = rounded<T>(static_cast<float>(up[i0 + l]));
    }
    lanes_store(s, silu(lanes_load(g)));
    for (int64_t l = 0; l < width; ++l) s[l] = rounded<T>(s[l]);
    lanes_store(s, lanes_load(s) * lanes_load(u));
    for (int64_t l = 0; l < width; ++l) out[i0 + l] = static_cast<T>(s[l]);
  }
}

// The mode's SiLU(gate) * up (models.invariant.InvariantOps.silu_mul, for the layers run from Python): gate and up
// of one shape and dtype, each row its own.
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  pybind11::gil_scoped_release free_python;
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "gate and up differ: ", gate.sizes(), " ", gate.scalar_type(), " and ", up.sizes(), " ",
              up.scalar_type());
  const auto g = gate.contiguous(), u = up.contiguous();
  auto out = torch::empty_like(g);
  const int64_t n = g.size(-1), rows = n == 0 ? 0 : g.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up_ = u.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    pool.run(rows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row<scalar_t>(gp + r * n, up_ + r * n, op + r * n, n);
    });
  });
  return out;
}

// rows [M, K] of the dtype T times a linear's weight (`linear_rows`' forms: [packed], or quantized blobs side by
// side) into out [M, N] float32. The GEMMs take float32 rows (widened into `wide`, [M, K]; a float32 model's rows as
// they are) or, for bf16 pairs, the bfloat16 rows themselves.
template <typename T>
static void linear_into(const T* rows, int64_t M, int64_t K, const std::vector<torch::Tensor>& weight, int64_t N,
                        float* wide, float* out) {
  const torch::Tensor& packed = weight[0];
  if (packed.dim() == 4) {  // bf16 pairs (a quantized blob is one dimension)
    TORCH_CHECK((std::is_same<T, c10::BFloat16>::value), "bf16 pairs take a bfloat16 model's rows");
    gemm_into(rows, M, K, packed, N, out);
    return;
  }
  const float* x = reinterpret_cast<const float*>(rows);
  if constexpr (!std::is_same<T, float>::value) {
    for (int64_t i = 0; i < M * K; ++i) wide[i] = static_cast<float>(rows[i]);
    x = wide;
  }
  if (packed.scalar_type() == torch::kByte) {
    const auto got = quant::rows(torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32), weight, false);
    std::memcpy(out, got.data_ptr<float>(), sizeof(float) * M * N);
  } else {
    gemm_into(x, M, K, packed, N, out);
  }
}

// The layers' loop for the dtype T: x [T, H] updated in place, the caches [layers, Hkv, S, D].
template <typename T>
static void layers_of(T* x, const T* cos, const T* sin, const std::vector<std::vector<torch::Tensor>>& weights,
                      int64_t layers, T* k_cache, T* v_cache, int64_t S, const int64_t* write_slot, const int64_t* query, int64_t R,
                      const int64_t* key_slots, const int64_t* counts, int64_t W, int64_t tokens, int64_t H,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps) {
  const int64_t QKV = (Hq + 2 * Hkv) * D, cache = Hkv * S * D;
  const float scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  // the buffers, in the dtype or float32 (the GEMMs' outputs and inputs, the attention's)
  std::vector<T> h(tokens * std::max(H, I)), q(tokens * Hq * D), k(tokens * Hkv * D), q_rope(q.size()),
      k_rope(k.size()), attended(tokens * Hq * D);
  std::vector<float> wide(tokens * std::max({H, I, Hq * D})), qkv(tokens * QKV), scaled(R * Hq * D),
      got(R * Hq * D), o(tokens * H), gate_up(tokens * 2 * I);
  const auto add_rows = [&](const float* y) {  // x + y rounded to the dtype: the residual add
    for (int64_t i = 0; i < tokens * H; ++i)
      x[i] = static_cast<T>(static_cast<float>(x[i]) + rounded<T>(y[i]));
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    const std::vector<torch::Tensor>* w = &weights[layer * 6];
    T* kc = k_cache + layer * cache;
    T* vc = v_cache + layer * cache;
    // attention: q, k and v from one GEMM, each rounded to the dtype; RoPE on q and k
    norm_rows_of<T>(x, w[0][0].data_ptr<T>(), h.data(), tokens, H, eps);
    linear_into<T>(h.data(), tokens, H, w[1], QKV, wide.data(), qkv.data());
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = qkv.data() + t * QKV;
      for (int64_t i = 0; i < Hq * D; ++i) q[t * Hq * D + i] = static_cast<T>(row[i]);
      for (int64_t i = 0; i < Hkv * D; ++i) k[t * Hkv * D + i] = static_cast<T>(row[Hq * D + i]);
    }
    rope_rows<T>(q.data(), cos, sin, q_rope.data(), tokens, Hq, D);
    rope_rows<T>(k.data(), cos, sin, k_rope.data(), tokens, Hkv, D);
    // each token's k and v at its write slot (the copies of index_copy_: no arithmetic)
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(write_slot[t] >= 0 && write_slot[t] < S, "write slot ", write_slot[t], " is outside the cache's ",
                  S);
      const float* v_row = qkv.data() + t * QKV + (Hq + Hkv) * D;
      for (int64_t g = 0; g < Hkv; ++g) {
        std::memcpy(kc + (g * S + write_slot[t]) * D, k_rope.data() + (t * Hkv + g) * D, sizeof(T) * D);
        T* v_slot = vc + (g * S + write_slot[t]) * D;
        for (int64_t d = 0; d < D; ++d) v_slot[d] = static_cast<T>(v_row[g * D + d]);
      }
    }
    // the queries' rows scaled in float32, attended; the padding tokens' outputs zero
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < Hq * D; ++i)
        scaled[r * Hq * D + i] = static_cast<float>(q_rope[query[r] * Hq * D + i]) * scale;
    attend<T>(scaled.data(), kc, vc, key_slots, counts, got.data(), R, Hq, Hkv, S, D, W);
    std::fill(attended.begin(), attended.end(), static_cast<T>(0.f));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < Hq * D; ++i) attended[query[r] * Hq * D + i] = static_cast<T>(got[r * Hq * D + i]);
    linear_into<T>(attended.data(), tokens, Hq * D, w[2], H, wide.data(), o.data());
    add_rows(o.data());
    // MLP: gate and up from one GEMM, SiLU(gate) * up, down
    norm_rows_of<T>(x, w[3][0].data_ptr<T>(), h.data(), tokens, H, eps);
    linear_into<T>(h.data(), tokens, H, w[4], 2 * I, wide.data(), gate_up.data());
    pool.run(tokens, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        silu_mul_row<T>(gate_up.data() + t * 2 * I, gate_up.data() + t * 2 * I + I, h.data() + t * I, I);
    });
    linear_into<T>(h.data(), tokens, I, w[5], H, wide.data(), o.data());
    add_rows(o.data());
  }
}

// The embedding's rows for the tokens' ids into x [T, H] of the dtype T, from `table`: the embedding's weight [V, H] in
// the dtype, a tied head's packed copy (cpu_kernels.Packed's blocks: [V / 64, H, 64] float32 or bfloat16 bits, or
// bf16 pairs [V / 64, H / 2, 64, 2]), or a quantized blob (dequantized as ggml does, then rounded to the dtype, as
// QuantEmbedding does). The same values the module's own lookup gives: a packed copy holds the weight's values.
template <typename T>
static void embed_rows(const int64_t* ids, int64_t tokens, const torch::Tensor& table, int64_t vocab, int64_t H,
                       T* x) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_INDEX(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " is outside the vocabulary's ", vocab,
                      " ids");
  if (table.scalar_type() == torch::kByte) {
    std::vector<float> rows(tokens * H);
    quant::rows_of(table, ids, tokens, rows.data());
    for (int64_t i = 0; i < tokens * H; ++i) x[i] = static_cast<T>(rows[i]);
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = ids[t], block = id / NB, column = id % NB;
    T* row = x + t * H;
    if (table.dim() == 2) {
      std::memcpy(row, table.data_ptr<T>() + id * H, sizeof(T) * H);
    } else if (table.dim() == 4) {  // bf16 pairs: k's value at [block, k / 2, column, k % 2]
      const auto* b = reinterpret_cast<const uint16_t*>(table.data_ptr()) + block * table.size(1) * NB * 2;
      for (int64_t k = 0; k < H; ++k) row[k] = static_cast<T>(widen(b[((k / 2) * NB + column) * 2 + k % 2]));
    } else if (table.scalar_type() == torch::kInt16) {  // bfloat16 bits: k's value at [block, k, column]
      const auto* b = reinterpret_cast<const uint16_t*>(table.data_ptr()) + block * H * NB;
      for (int64_t k = 0; k < H; ++k) row[k] = static_cast<T>(widen(b[k * NB + column]));
    } else {
      const float* b = table.data_ptr<float>() + block * H * NB;
      for (int64_t k = 0; k < H; ++k) row[k] = static_cast<T>(b[k * NB + column]);
    }
  }
}

// The logits of x's rows `rows` [R]: each through the final norm and the head (`linear_into`), every logit rounded to
// the dtype (as `InvariantOps.norm` and the head's `side_by_side` give them) into logits [R, V].
template <typename T>
static void logits_of(const T* x, int64_t tokens, int64_t H, const int64_t* rows, int64_t R, const T* norm,
                      const std::vector<torch::Tensor>& head, int64_t V, float eps, T* logits) {
  std::vector<T> picked(R * H), normed(R * H);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_INDEX(rows[r] >= 0 && rows[r] < tokens, "logits row ", rows[r], " is outside the step's ", tokens,
                      " tokens");
    std::memcpy(picked.data() + r * H, x + rows[r] * H, sizeof(T) * H);
  }
  norm_rows_of<T>(picked.data(), norm, normed.data(), R, H, eps);
  std::vector<float> wide(R * H);
  if constexpr (std::is_same<T, float>::value) {
    linear_into<T>(normed.data(), R, H, head, V, wide.data(), logits);
  } else {
    std::vector<float> out(R * V);
    linear_into<T>(normed.data(), R, H, head, V, wide.data(), out.data());
    pool.run(R, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * V; i < r1 * V; ++i) logits[i] = static_cast<T>(out[i]);
    });
  }
}

// A packed step of a LLaMA model (no biases, no q/k norms) in the batch-invariant mode, from its token ids to its
// logits, in one call: the embedding's rows, the decoder layers (the ops of models.blocks' forward as the mode runs
// them from Python: the GEMMs, `norm_rows`, RoPE, the attention, `silu_mul`, each output rounded to the dtype where
// an ATen op's would be), then the final norm and the head over the rows that need logits: the bits of the model's
// forward run op by op, without an op between.
// ids [T] int64; embedding: the table of `embed_rows`; cos, sin [1, T, 1, D] in the model's dtype (the activations');
// weights: per layer the input norm's weight, q/k/v side by side, o, the post-attention norm's weight, gate/up side by
// side, down, then the final norm's weight and the head (each a list: [weight] for a norm, [packed] for a packed
// weight, one quantized blob per linear for quantized ones); k_cache, v_cache [layers, Hkv, S, D]; write_slots [T]
// int64, where each token's key and value go; queries [R] int64, the tokens that attend (the rest are padding: their
// attention output is zero), key_slots [R, W] and counts [R] int64, each query's key slots in position order
// (`cpu_kernels.attention`'s); head_rows [R'] int64, the tokens whose logits are wanted. Returns the logits
// [1, R', vocab] in the model's dtype.
torch::Tensor decoder_step(torch::Tensor ids, torch::Tensor embedding, torch::Tensor cos, torch::Tensor sin,
                           std::vector<std::vector<torch::Tensor>> weights, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor write_slots, torch::Tensor queries,
                           torch::Tensor key_slots, torch::Tensor counts, torch::Tensor head_rows, int64_t heads,
                           int64_t kv_heads, int64_t intermediate, int64_t vocab, double eps) {
  pybind11::gil_scoped_release free_python;
  TORCH_CHECK(weights.size() >= 2 && (weights.size() - 2) % 6 == 0,
              "weights must be six lists per layer, then the final norm's and the head's; got ", weights.size());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && embedding.is_contiguous(),
              "the caches and the embedding's table must be contiguous");
  const auto dtype = cos.scalar_type();
  const int64_t layers = int64_t(weights.size() - 2) / 6;
  for (size_t i = 0; i < weights.size(); ++i)
    for (auto& w : weights[i]) {
      // a norm's weight, in the dtype as `norm_rows` takes it
      const bool norm = int64_t(i) < 6 * layers ? i % 6 == 0 || i % 6 == 3 : int64_t(i) == 6 * layers;
      if (norm && (w.scalar_type() != dtype || !w.is_contiguous())) w = w.to(dtype).contiguous();
      TORCH_CHECK(w.is_contiguous(), "a layer's weight is not contiguous");
    }
  TORCH_CHECK(embedding.dim() != 2 || embedding.scalar_type() == dtype || embedding.scalar_type() == torch::kByte,
              "the embedding's weight is ", embedding.scalar_type(), ", the step's dtype ", dtype);
  const auto ids_ = ids.to(torch::kInt64).contiguous(), rows = head_rows.to(torch::kInt64).contiguous();
  const auto cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  const int64_t T = ids_.numel(), H = weights[6 * layers][0].numel(), D = cos.size(-1);
  auto x = torch::empty({T, H}, cos.options());
  auto logits = torch::empty({1, rows.numel(), vocab}, cos.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "decoder_step", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    embed_rows<scalar_t>(ids_.data_ptr<int64_t>(), T, embedding, vocab, H, xp);
    layers_of<scalar_t>(xp, cos_rows.data_ptr<scalar_t>(), sin_rows.data_ptr<scalar_t>(), weights, layers,
                        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k_cache.size(2),
                        write_slots.data_ptr<int64_t>(), queries.data_ptr<int64_t>(), queries.size(0),
                        key_slots.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), key_slots.size(1), T, H, heads,
                        kv_heads, D, intermediate, static_cast<float>(eps));
    logits_of<scalar_t>(xp, T, H, rows.data_ptr<int64_t>(), rows.numel(), weights[6 * layers][0].data_ptr<scalar_t>(),
                        weights[6 * layers + 1], vocab, static_cast<float>(eps), logits.data_ptr<scalar_t>());
  });
  return logits;
}

// Whether any of 16 values may rank above `worst`: is not at most it (a NaN value, or a NaN worst, may).
template <typename T>
static inline bool any_above(const T* v, float worst) {
#if defined(__AVX512F__)
  __m512 lanes;
  if constexpr (std::is_same<T, float>::value) {
    lanes = _mm512_loadu_ps(v);
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    lanes = load16(reinterpret_cast<const uint16_t*>(v));
  } else if constexpr (std::is_same<T, c10::Half>::value) {
    lanes = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
  } else {
    lanes = _mm512_set_ps(v[15], v[14], v[13], v[12], v[11], v[10], v[9], v[8], v[7], v[6], v[5], v[4], v[3], v[2],
                          v[1], v[0]);
  }
  return _mm512_cmp_ps_mask(lanes, _mm512_set1_ps(worst), _CMP_NLE_UQ) != 0;
#else
  bool any = false;
  for (int l = 0; l < 16; ++l) any |= !(static_cast<float>(v[l]) <= worst);
  return any;
#endif
}

// One row's k best ids (k >= 1) into ids, best first: larger values first, NaN above every number (as torch's argmax
// and topk rank it), the lower id first among equals. One pass in id order: a value enters only where it beats the
// k-th kept one, so equal values keep the earlier id; once k are kept, a run of 16 values none of which can enter
// (each at most the k-th: one vector comparison) is passed over whole.
template <typename T>
static void best_of(const T* row, int64_t V, int64_t k, float* values, int64_t* ids) {
  const auto beats = [](float a, float b) { return a > b || (a != a && b == b); };  // a ranks above b
  int64_t kept = 0;
  for (int64_t i0 = 0; i0 < V; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, V - i0);
    if (kept == k && n == 16) {
      if (!any_above(row + i0, values[k - 1])) continue;
    }
    for (int64_t i = i0; i < i0 + n; ++i) {
      const float v = static_cast<float>(row[i]);
      if (kept == k && !beats(v, values[k - 1])) continue;
      int64_t p = kept < k ? kept++ : k - 1;  // where it goes: past every kept value it does not beat
      for (; p > 0 && beats(v, values[p - 1]); --p) {
        values[p] = values[p - 1];
        ids[p] = ids[p - 1];
      }
      values[p] = v;
      ids[p] = i;
    }
  }
}

// What a step fetches of its logits [R, V] (programs.StepProgram): each row's argmax (the first largest, NaN
// largest: torch.argmax's answer), then, for k > 0, each row's k largest ids, largest first (the lower id first among
// equals): int64 [R + R * k]. One pass over each row, where torch's argmax and topk took about a millisecond each
// over a lookahead step's rows.
torch::Tensor top_ids(torch::Tensor logits, int64_t k) {
  pybind11::gil_scoped_release free_python;
  TORCH_CHECK(logits.dim() == 2 && k >= 0 && k <= logits.size(1), "logits must be [R, V] with 0 <= k <= V; got ",
              logits.sizes(), " and k = ", k);
  const auto rows = logits.contiguous();
  const int64_t R = rows.size(0), V = rows.size(1), keep = std::max<int64_t>(k, 1);
  auto out = torch::empty({R + R * k}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  TORCH_CHECK(V > 0 || R == 0, "logits rows must not be empty");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "top_ids", [&] {
    const scalar_t* l = rows.data_ptr<scalar_t>();
    pool.run(R, [&](int64_t r0, int64_t r1) {
      std::vector<float> values(keep);
      std::vector<int64_t> ids(keep);
      for (int64_t r = r0; r < r1; ++r) {
        best_of<scalar_t>(l + r * V, V, keep, values.data(), ids.data());
        o[r] = ids[0];
        for (int64_t j = 0; j < k; ++j) o[R + r * k + j] = ids[j];
      }
    });
  });
  return out;
}
