"""Loading a llama.cpp GGUF file as it is: its config from the file's metadata, its weights kept quantized
(`models.quantized`, on a CPU with the package's kernels) or dequantized once (CUDA, or no C++ compiler), its tokenizer
and chat template from the file (`gguf_tokenizer`).

Architectures: llama (Llama 1-3, Mistral's files, SmolLM; Llama 3's RoPE scaling as the file's `rope_freqs`), qwen2,
qwen3. Tensor types: F32, F16, BF16 and `lookahead.kernels.quant.TYPES`; any other type is refused by name.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lookahead.kernels import quant

from .config import LlamaConfig
from .quantized import QuantEmbedding, QuantLinear

ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}  # BF16 is read through its bits
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file of a folder that holds no safetensors
    checkpoint; None for a safetensors folder. A folder with several GGUF files is refused (name the file)."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}): "
                         "pass the one to load")
    return found[0] if found else None


def read(path: Path):
    """The file's reader (memory-mapped), or a clear error for a damaged or foreign file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); is it truncated or damaged?"
                         ) from None


def config_of(reader, path: Path) -> tuple[LlamaConfig, dict]:
    """The model's config from the file's metadata (what llama.cpp reads), and the metadata itself."""
    big = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    meta = {name: field.contents() for name, field in reader.fields.items() if name not in big}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path} holds a {arch!r} model; GGUF files of {', '.join(ARCHITECTURES)} load here")
    names = {t.name for t in reader.tensors}

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path} lacks the metadata {arch}.{key}")
        return value

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    raw = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length") or get("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported (linear, or Llama 3's rope_freqs)")
    return LlamaConfig.from_dict(raw), meta


def load(cls, path: Path, dtype: torch.dtype, device: torch.device, **options):
    """A `cls` (Llama) with the GGUF file's weights: quantized linears and embedding kept quantized on a CPU whose
    kernels are built, dequantized to `dtype` elsewhere (said in a warning)."""
    from .invariant import runs_cpu_kernels
    from .rope import inverse_frequencies

    reader = read(path)
    config, meta = config_of(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in FLOAT_TYPES and kind != "BF16" and kind not in quant.LAYOUTS:
            raise ValueError(f"{path}: tensor {t.name} is {kind}, which is not supported (supported: F32, F16, "
                             f"BF16, {', '.join(quant.TYPES)})")
    keep = runs_cpu_kernels(device)
    loaded: set[str] = set()
    if not keep and any(t.tensor_type.name in quant.LAYOUTS for t in reader.tensors):
        why = "on CUDA" if device.type == "cuda" else "without the package's CPU kernels (no C++ compiler)"
        warnings.warn(f"{path.name}: quantized weights are dequantized to {str(dtype).removeprefix('torch.')} at "
                      f"load {why}: more memory, and not the file's arithmetic", stacklevel=3)
    with torch.device("meta"):
        model = cls(config, **options)
    permute = meta["general.architecture"] == "llama"  # llama.cpp's converter permutes llama's q/k rows for its RoPE
    floats = []
    for name, t in tensors.items():  # quantized weights first, packed into modules on the meta-built model
        if name == "rope_freqs.weight":  # Llama 3's scaled frequencies: inv_freq / factor, per frequency
            continue
        target = hf_name(name, path)
        shape = [int(n) for n in reversed(t.shape)]
        raw = np.asarray(t.data)
        heads = {"self_attn.q_proj.weight": config.num_attention_heads,
                 "self_attn.k_proj.weight": config.num_key_value_heads}.get(target.split(".", 3)[-1])
        if permute and heads is not None:
            raw = unpermute(raw.reshape(shape[0], -1), heads)
        module_name, _, param = target.rpartition(".")
        module = _module(model, module_name, name, path)
        kind = t.tensor_type.name
        if not (kind in quant.LAYOUTS and keep and param == "weight"):
            floats.append((name, target, param, raw, kind, shape))
            continue
        if (module.weight.shape[0], module.weight.shape[1]) != tuple(shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(shape)}, the metadata implies "
                             f"{tuple(module.weight.shape)}")
        blob = quant.pack_ggml(raw, kind, *shape)
        parent_name, _, child = module_name.rpartition(".")
        replacement = (QuantEmbedding(blob, dtype) if isinstance(module, nn.Embedding)
                       else QuantLinear(blob, module.bias))
        model.get_submodule(parent_name).register_module(child, replacement)
        loaded.add(target)
    # then memory for the rest (norms, biases, float weights) only: the quantized ones never exist in float
    model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t)
    for name, target, param, raw, kind, shape in floats:
        value = torch.from_numpy(_floats(raw, kind, shape)).reshape(shape)
        current = getattr(model.get_submodule(target.rpartition(".")[0]), param)
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(value.shape)}, the metadata implies "
                             f"{tuple(current.shape)}")
        if not torch.isfinite(value).all():
            raise ValueError(f"{path}: tensor {name} holds NaN or inf values: the file is damaged")
        with torch.no_grad():
            current.copy_(value)
        loaded.add(target)
    for layer in model.model.layers:  # QuantLinears may have replaced merged linears
        layer.self_attn.merge(), layer.mlp.merge()
    if config.tie_word_embeddings:
        model.lm_head = (QuantLinear(model.model.embed_tokens.weight)
                         if isinstance(model.model.embed_tokens, QuantEmbedding) else model.lm_head)
        model._tie_weights()
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{path} lacks tensor(s) for {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
    inv_freq = inverse_frequencies(config.head_dim, config.rope)
    if "rope_freqs.weight" in tensors:
        inv_freq = inv_freq / torch.from_numpy(np.array(tensors["rope_freqs.weight"].data, np.float32))
    model.rope_inv_freq = inv_freq.to(device)
    del reader, tensors, floats  # the file's mapping and fields: then their memory can go back
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Give the packing's freed temporaries back to the system: glibc keeps a few hundred of numpy's medium-sized
    buffers in its heap otherwise (about a sixth of a small model's size, measured)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to do
        pass


def _module(model: nn.Module, name: str, tensor: str, path: Path) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{path}: tensor {tensor} has no place in this {model.config.model_type} model") from None


def _floats(raw: np.ndarray, kind: str, shape: list[int]) -> np.ndarray:
    if kind in FLOAT_TYPES:
        return np.asarray(raw).view(FLOAT_TYPES[kind]).astype(np.float32)
    if kind == "BF16":
        return (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize  # a quantized tensor where it is not kept quantized

    return dequantize(np.asarray(raw).reshape(shape[0], -1), GGMLQuantizationType[kind]).astype(np.float32)


def hf_name(gguf_name: str, path: Path) -> str:
    """The Hugging Face name of a LLaMA-shaped model's GGUF tensor (`path` names the file in the error)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path}: tensor {gguf_name!r} is not one of a LLaMA-shaped model's")


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter's permute of q/k rows (heads, 2, d/2) -> (heads, d/2, 2): whole rows move,
    so a quantized row's blocks move with it."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tokenizer(path: Path):
    """The file's tokenizer with its chat template, through transformers' GGUF reader."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
