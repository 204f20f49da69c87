"""`LlamaConfig`: what the model needs from a Hugging Face `config.json`, checked on the way in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json this implementation cannot run; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: theta and one of the scalings `default`, `linear`, `llama3`."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        """Read both spellings: `rope_theta` + `rope_scaling` (older) and `rope_parameters` (newer)."""
        params = raw.get("rope_parameters")
        if params is None:
            params = dict(raw.get("rope_scaling") or {})
            params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ConfigError(f"rope type {rope_type!r} (rope_scaling/rope_parameters) is not supported; "
                              f"supported: {', '.join(_ROPE_TYPES)}")
        kwargs: dict[str, Any] = {"theta": float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
                                  "type": rope_type}
        if rope_type in ("linear", "llama3"):
            if "factor" not in params:
                raise ConfigError(f"rope type {rope_type!r} needs a 'factor' in rope_scaling/rope_parameters")
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if name not in params:
                    raise ConfigError(f"rope type 'llama3' needs {name!r} in rope_scaling/rope_parameters")
                kwargs[name] = params[name]
        return cls(**kwargs)


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture of a LLaMA-family checkpoint (MHA, GQA or MQA)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def kv_group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed config.json, refusing what this implementation cannot run."""
        model_type = raw.get("model_type")
        if model_type != "llama":
            raise ConfigError(f"model_type {model_type!r} is not supported (only 'llama')")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(name), int) or raw[name] <= 0:
                raise ConfigError(f"config field {name!r} must be a positive int, got {raw.get(name)!r}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=RopeConfig.from_hf(raw),
            eos_token_id=_as_ids(eos),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read `config.json` (a file or the checkpoint folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}: is this a Hugging Face checkpoint folder?") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        generation = path.with_name("generation_config.json")
        if generation.is_file():  # its eos_token_id is the one generation stops at
            eos = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is not None:
                raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
