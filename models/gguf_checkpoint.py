"""Writing a Hugging Face LLaMA checkpoint folder for a llama.cpp GGUF file (what the default model is converted into:
`default_model.py`): float32 weights with HF's names and q/k row order, config.json, generation_config.json, and the
tokenizer files with the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .gguf import hf_name, unpermute

TOKENIZER_STAGES = ("loading transformers", "reading the tokenizer", "saving the tokenizer")


def write(gguf_path: Path, out_dir: Path, bar, damaged_hint: str) -> None:
    """The checkpoint of `gguf_path` (a llama model) into `out_dir`, each stage named on `bar` (a tqdm bar, whose total
    this sets once the file is read) as it starts. A file that cannot be read is a ValueError ending in
    `damaged_hint` (what to do about it)."""
    bar.set_postfix_str("reading the GGUF", refresh=True)
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {gguf_path} ({type(e).__name__}: {e}); is it truncated or damaged? "
                         f"{damaged_hint}") from None
    bar.total = 1 + len(reader.tensors) + 1 + len(TOKENIZER_STAGES)
    bar.update()
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    meta = {name: field.contents() for name, field in reader.fields.items() if name not in big}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} holds a {meta.get('general.architecture')!r} model, not 'llama'")
    config = _hf_config(meta, reader)
    tensors = {}
    bar.set_postfix_str("weights")
    for t in reader.tensors:
        try:
            array = dequantize(t.data, t.tensor_type).astype(np.float32)
            array = array.reshape([int(n) for n in reversed(t.shape)])
        except (ValueError, IndexError) as e:
            raise ValueError(f"cannot read tensor {t.name!r} of {gguf_path} ({e}); is the file truncated? "
                             f"{damaged_hint}") from None
        name = hf_name(t.name, gguf_path)
        # llama.cpp stores q/k rows permuted for its RoPE layout; undo it for HF's rotate-half layout
        if name.endswith("q_proj.weight"):
            array = unpermute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute(array, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
        bar.update()
    bar.set_postfix_str("saving the weights", refresh=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    bar.update()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    _write_tokenizer(gguf_path, out_dir, bar)


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


def _write_tokenizer(gguf_path: Path, out_dir: Path, bar) -> None:
    """The tokenizer files with the chat template, each stage (`TOKENIZER_STAGES`) named on `bar` as it starts."""
    bar.set_postfix_str(TOKENIZER_STAGES[0], refresh=True)
    from transformers import AutoTokenizer

    bar.update()
    bar.set_postfix_str(TOKENIZER_STAGES[1], refresh=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    bar.update()
    bar.set_postfix_str(TOKENIZER_STAGES[2], refresh=True)
    tokenizer.save_pretrained(str(out_dir))
    bar.update()
