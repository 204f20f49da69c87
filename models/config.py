"""`LlamaConfig`: what the model needs from a Hugging Face `config.json`, checked on the way in."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lookahead.inputs import token_ids

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
        """Read both spellings: `rope_theta` + `rope_scaling` (older) and `rope_parameters` (newer).

        With both present, transformers uses a non-empty `rope_scaling` whole and ignores `rope_parameters`
        (theta then comes from `rope_scaling`, else the top-level `rope_theta`, else 10000); so does this.
        """
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
        where, params = ("rope_scaling", scaling) if scaling else ("rope_parameters", raw.get("rope_parameters"))
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ConfigError(f"config field {where!r} must be an object or null, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ConfigError(f"rope type {rope_type!r} ({where}) is not supported; "
                              f"supported: {', '.join(_ROPE_TYPES)}")
        if "rope_theta" in params:
            theta = _number(params, "rope_theta", where=where)
        else:
            theta = _number(raw, "rope_theta", default=10000.0)
        kwargs: dict[str, Any] = {"theta": theta, "type": rope_type}
        if rope_type in ("linear", "llama3"):
            if "factor" not in params:
                raise ConfigError(f"rope type {rope_type!r} needs a 'factor' in {where}")
            kwargs["factor"] = _number(params, "factor", where=where)
        if rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if name not in params:
                    raise ConfigError(f"rope type 'llama3' needs {name!r} in {where}")
            kwargs["low_freq_factor"] = _number(params, "low_freq_factor", where=where)
            kwargs["high_freq_factor"] = _number(params, "high_freq_factor", where=where)
            if kwargs["high_freq_factor"] <= kwargs["low_freq_factor"]:
                raise ConfigError(f"{where}['high_freq_factor'] ({kwargs['high_freq_factor']}) must exceed "
                                  f"{where}['low_freq_factor'] ({kwargs['low_freq_factor']})")
            kwargs["original_max_position_embeddings"] = _int(params, "original_max_position_embeddings", where=where)
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
        """Build from a parsed config.json, type-checking every field it reads and refusing what it cannot run."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != "llama":
            raise ConfigError(f"model_type {model_type!r} is not supported (only 'llama')")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        return cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_int(raw, "num_key_value_heads", default=heads, null_is_default=True),
            head_dim=_int(raw, "head_dim", default=hidden // heads, null_is_default=True),
            max_position_embeddings=_int(raw, "max_position_embeddings", default=2048),
            rms_norm_eps=_number(raw, "rms_norm_eps", default=1e-6),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            attention_bias=_bool(raw, "attention_bias", default=False),
            mlp_bias=_bool(raw, "mlp_bias", default=False),
            rope=RopeConfig.from_hf(raw),
            eos_token_id=_eos(raw.get("eos_token_id"), "eos_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read `config.json` (a file or the checkpoint folder holding it) and generation_config.json beside it."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}: is this a Hugging Face checkpoint folder?")
        raw = _read_json(path)
        generation = path.with_name("generation_config.json")
        if generation.is_file():  # its eos_token_id is the one generation stops at
            gen = _read_json(generation)
            if not isinstance(gen, dict):
                raise ConfigError(f"{generation} must hold a JSON object, got {type(gen).__name__}")
            if gen.get("eos_token_id") is not None and isinstance(raw, dict):
                raw = {**raw, "eos_token_id": _eos(gen["eos_token_id"], f"{generation.name} eos_token_id")}
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


_MISSING = object()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _field(name: str, where: str | None) -> str:
    return f"{where}[{name!r}]" if where else f"config field {name!r}"


def _get(raw: dict, name: str, default: Any, where: str | None, null_is_default: bool = False) -> Any:
    value = raw.get(name, default)
    if value is None and null_is_default:
        value = default
    if value is _MISSING:
        raise ConfigError(f"{_field(name, where)} is required")
    return value


def _int(raw: dict, name: str, default: Any = _MISSING, where: str | None = None,
         null_is_default: bool = False) -> int:
    """A positive int (not a bool, not a float such as 2.0)."""
    value = _get(raw, name, default, where, null_is_default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{_field(name, where)} must be a positive int, got {value!r}")
    return value


def _number(raw: dict, name: str, default: Any = _MISSING, where: str | None = None) -> float:
    """A finite number > 0 (an int or a float, not a bool or a string)."""
    value = _get(raw, name, default, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{_field(name, where)} must be a finite number > 0, got {value!r}")
    return float(value)


def _bool(raw: dict, name: str, default: bool) -> bool:
    """true or false (the JSON literals: the string "false" is refused, not read as true)."""
    value = _get(raw, name, default, None)
    if not isinstance(value, bool):
        raise ConfigError(f"{_field(name, None)} must be true or false, got {value!r}")
    return value


def _eos(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    try:
        return token_ids(value, name)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
