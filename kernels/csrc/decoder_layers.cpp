// A packed step's decoder layers in one call (lookahead.kernels.cpu_kernels.decoder_layers), and the mode's SiLU:
// built last in the one translation unit (it uses cpu_kernels.cpp's GEMM, norm and RoPE, chain_attention.cpp's
// attention and lanes, quant_gemm.cpp's quantized rows). Between the GEMMs and the attention every step is a loop
// over raw buffers made once per call, so a decoding step runs no ATen op per layer: each op once cost a few
// microseconds of dispatch and allocation, about a dozen a layer, where a small model's layer reads its weights in
// a few hundred.

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
                      T* k_cache, T* v_cache, int64_t S, const int64_t* write_slot, const int64_t* query, int64_t R,
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
  for (size_t layer = 0; layer * 6 < weights.size(); ++layer) {
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

// The decoder layers of a LLaMA model (no biases, no q/k norms) over a packed step in the batch-invariant mode: the
// ops of models.blocks' forward as the mode runs them from Python (the GEMMs, `norm_rows`, RoPE, the attention,
// `silu_mul`, each output rounded to the dtype where an ATen op's would be), so the same bits, in one call. x [1, T,
// H] (the model's dtype); cos, sin [1, T, 1, D] in that dtype; weights: per layer, the input norm's weight, q/k/v
// side by side, o, the post-attention norm's weight, gate/up side by side, down (each a list: [weight] for a norm,
// [packed] for a packed weight, one quantized blob per linear for quantized ones); k_cache, v_cache [layers, Hkv, S,
// D]; write_slots [T] int64, where each token's key and value go; queries [R] int64, the tokens that attend (the
// rest are padding: their attention output is zero), key_slots [R, W] and counts [R] int64, each query's key slots
// in position order (`cpu_kernels.attention`'s). Returns x after the last layer.
torch::Tensor decoder_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                             std::vector<std::vector<torch::Tensor>> weights, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor write_slots, torch::Tensor queries,
                             torch::Tensor key_slots, torch::Tensor counts, int64_t heads, int64_t kv_heads,
                             int64_t intermediate, double eps) {
  pybind11::gil_scoped_release free_python;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  auto out = x.contiguous().clone();
  const auto cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  for (size_t i = 0; i < weights.size(); ++i)
    for (auto& w : weights[i]) {
      const bool norm = i % 6 == 0 || i % 6 == 3;  // a norm's weight, in the dtype as `norm_rows` takes it
      if (norm && (w.scalar_type() != x.scalar_type() || !w.is_contiguous())) w = w.to(x.scalar_type()).contiguous();
      TORCH_CHECK(w.is_contiguous(), "a layer's weight is not contiguous");
    }
  const int64_t T = x.size(1), H = x.size(2), D = cos.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "decoder_layers", [&] {
    layers_of<scalar_t>(out.data_ptr<scalar_t>(), cos_rows.data_ptr<scalar_t>(), sin_rows.data_ptr<scalar_t>(),
                        weights, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k_cache.size(2),
                        write_slots.data_ptr<int64_t>(), queries.data_ptr<int64_t>(), queries.size(0),
                        key_slots.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), key_slots.size(1), T, H, heads,
                        kv_heads, D, intermediate, static_cast<float>(eps));
  });
  return out;
}
