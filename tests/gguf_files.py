"""Tiny GGUF files written as llama.cpp's converter writes them (its tensor names, its q/k row permutation for llama,
its metadata keys), with weights of any supported type, and the transformers model that holds exactly the file's
dequantized weights: the independent reference a loaded GGUF model is compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lookahead.kernels import quant

HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# K-quants have no quantizer in gguf-py: their blocks are random codes with small float16 scales and, so that the
# weights stay centred and of a trained model's size, Q4_K's six-bit scales 2 and mins 15 (w = d (2 q - 15)) and Q6_K's
# sub-block scales 1..8 (the kernel's own test covers random scales); the reference holds what they dequantize to
_Q4_K_SCALES = np.array([2, 2, 2, 2, 15, 15, 15, 15, 0xF2, 0xF2, 0xF2, 0xF2], np.uint8)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, _, param = rest.rpartition(".")
        return f"blk.{layer}.{HF_TO_GGUF[module]}.{param}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permute of llama's q/k rows (for its RoPE layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _raw(w: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name not in ("Q4_K", "Q6_K"):
        return quantize(w.astype(np.float32), GGMLQuantizationType[type_name])
    layout = quant.LAYOUTS[type_name]
    n, k = w.shape
    raw = rng.integers(0, 256, (n, k // layout.weights, layout.block_bytes), dtype=np.uint8)
    scale = 0.005 if type_name == "Q4_K" else 0.0006  # weights of about 0.04, as the others'
    d = np.abs(rng.standard_normal((n, k // layout.weights, 1)) * scale).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        raw[..., 0:2] = raw[..., 2:4] = d  # dmin = d
        raw[..., 4:16] = _Q4_K_SCALES
    else:
        raw[..., 192:208] = rng.integers(1, 9, (n, k // layout.weights, 16), dtype=np.uint8)
        raw[..., 208:210] = d
    return raw.reshape(n, -1)


def llama3_factors(config) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for a Llama 3 RoPE scaling: each frequency's divisor."""
    scaling = config.rope_scaling
    base = config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] -
                                                                     scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path: Path, types: str | dict[str, str], family: str = "llama", seed: int = 0, tied: bool = False,
               **overrides):
    """Write a tiny random `family` model (llama, qwen2, qwen3) to the GGUF file `path`, its 2-D weights in
    `types` (one type for all, or {GGUF tensor name suffix such as 'attn_v' or 'token_embd': type}, others Q8_0;
    F32, F16 and BF16 too), and return the transformers model holding the file's weights dequantized (the
    reference). A Llama 3 `rope_scaling` in `overrides` is written as llama.cpp writes it: a `rope_freqs` tensor."""
    import transformers
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    kwargs = dict(vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tied, rope_theta=10000.0,
                  rms_norm_eps=1e-5)
    if family == "qwen3":
        kwargs["head_dim"] = 64
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else 10000.0)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(2)
    if family == "qwen3":
        writer.add_key_length(64)
        writer.add_value_length(64)
    if (getattr(config, "rope_scaling", None) or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_factors(config))
    state = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            w = p.float().numpy()
            if w.ndim == 1:  # norms and biases: random around their init, so a misplaced one shows
                w = (w + rng.standard_normal(w.shape).astype(np.float32) * 0.1).astype(np.float32)
                writer.add_tensor(gguf_name(name), w)
                state[name] = torch.from_numpy(w)
                continue
            w = w * 4.0  # larger than the init, so outputs depend on context
            target = gguf_name(name)
            kind = types if isinstance(types, str) else next(
                (t for suffix, t in types.items() if target.split(".")[-2] == suffix), "Q8_0")
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
                target.split(".")[-2])
            if family == "llama" and heads is not None:
                w = permute(w, heads)
            if kind in ("F32", "F16"):
                raw = w.astype(np.float32 if kind == "F32" else np.float16)
                held = raw.astype(np.float32)
                writer.add_tensor(target, raw)
            else:
                raw = _raw(w, kind, rng)
                writer.add_tensor(target, raw, raw_dtype=GGMLQuantizationType[kind])
                held = dequantize(raw, GGMLQuantizationType[kind]).reshape(w.shape).astype(np.float32)
            if family == "llama" and heads is not None:  # the reference holds HF's row order
                held = held.reshape(heads, held.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(held.shape)
            state[name] = torch.from_numpy(np.ascontiguousarray(held))
        if tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
