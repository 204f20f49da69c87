"""`LlamaConfig`: what the model needs from a Hugging Face `config.json`, checked on the way in."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lookahead.request import token_ids

_ROPE_TYPES = ("default", "linear", "llama3")
_MAX_SIZE = 2**31  # no model comes near this in any dimension: a bigger size is a damaged config.json


@dataclass(frozen=True)
class _Family:
    """How one model_type's config.json maps onto `LlamaConfig`: what transformers' class for it reads.

    A bias is a config field naming it or a fixed value; `head_dim` and `max_position_embeddings` are the
    defaults when config.json has none; `window` says how the family spells a sliding window.
    """

    qkv_bias: str | bool
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool
    head_dim: int | None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int
    window: str | None  # None (never), "mistral" (every layer), "qwen" (use_sliding_window, per layer)


FAMILIES = {
    "llama": _Family("attention_bias", "attention_bias", "mlp_bias", False, None, 2048, None),
    "mistral": _Family(False, False, False, False, None, 4096 * 32, "mistral"),
    "qwen2": _Family(True, False, False, False, None, 32768, "qwen"),  # q/k/v biases whatever the config says
    "qwen3": _Family("attention_bias", "attention_bias", False, True, 128, 32768, "qwen"),
}


MAX_ROPE_THETA = 1e12  # the largest RoPE base accepted


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

    def __post_init__(self) -> None:
        # a base <= 1 has no slow dimension (every frequency >= 1 radian a position) and 1e-300 overflows the
        # frequencies to inf (the model then gives token 0 every step); released checkpoints use 1e4 to a few 1e9
        if (isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or not math.isfinite(self.theta)
                or not 1 < self.theta <= MAX_ROPE_THETA):
            raise ConfigError(f"config field 'rope_theta' must be a number in (1, {MAX_ROPE_THETA:g}] (the RoPE base; "
                              f"checkpoints use 1e4 to a few 1e9), got {self.theta!r}")

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
    """The architecture of a LLaMA-shaped checkpoint (MHA, GQA or MQA): LLaMA, Mistral, Qwen2/Qwen2.5, Qwen3 dense.

    The families differ only in fields: `qkv_bias` (biases on q/k/v_proj), `o_bias` (on o_proj), `mlp_bias`,
    and `qk_norm` (Qwen3: an RMSNorm over each head's q and k before RoPE); `model_type` is config.json's.
    """

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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_id: tuple[int, ...] = ()
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed config.json, type-checking every field it reads and refusing what it cannot run."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            raise ConfigError(f"model_type {model_type!r} is not supported natively (supported: "
                              f"{', '.join(sorted(FAMILIES))}); to decode a model loaded with transformers instead, "
                              "use lookahead.hf.generate(hf_model, input_ids, ...), which also drives Mixtral, "
                              "Qwen3-MoE, Gemma, Phi-3, OLMo 2, Granite and Cohere")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = _size(raw, "num_attention_heads")
        hidden = _size(raw, "hidden_size")
        layers = _size(raw, "num_hidden_layers")
        max_positions = _int(raw, "max_position_embeddings", default=family.max_position_embeddings)
        _check_window(raw, family, max_positions, layers)
        return cls(
            vocab_size=_size(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_size(raw, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_size(raw, "num_key_value_heads", default=heads, null_is_default=True),
            head_dim=_size(raw, "head_dim", default=family.head_dim or hidden // heads, null_is_default=True),
            max_position_embeddings=max_positions,
            rms_norm_eps=_number(raw, "rms_norm_eps", default=1e-6),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            qkv_bias=_flag(raw, family.qkv_bias),
            o_bias=_flag(raw, family.o_bias),
            mlp_bias=_flag(raw, family.mlp_bias),
            qk_norm=family.qk_norm,
            rope=RopeConfig.from_hf(raw),
            eos_token_id=_eos(raw.get("eos_token_id"), "eos_token_id"),
            model_type=model_type,
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


def _size(raw: dict, name: str, default: Any = _MISSING, null_is_default: bool = False) -> int:
    """A positive int that sizes tensors: refused past `_MAX_SIZE`, before anything is allocated."""
    value = _int(raw, name, default, null_is_default=null_is_default)
    if value >= _MAX_SIZE:
        raise ConfigError(f"{_field(name, None)} is {value}, larger than any model's (the limit is 2**31 - 1): "
                          "is config.json damaged?")
    return value


def _flag(raw: dict, spec: str | bool) -> bool:
    """A family's fixed value, or the config field it reads (false when absent)."""
    return spec if isinstance(spec, bool) else _bool(raw, spec, default=False)


def _check_window(raw: dict, family: _Family, max_positions: int, layers: int) -> None:
    """Refuse a sliding window that could cut attention short: this implementation attends to every position.

    A window at least max_position_embeddings never does (mask: key j visible from i iff i - j < window).
    """
    if family.window is None:
        return
    default_window = 4096  # transformers' MistralConfig / Qwen2Config / Qwen3Config default
    if family.window == "mistral":
        window, sliding_layers = raw.get("sliding_window", default_window), layers
    else:  # Qwen: a window only with use_sliding_window, on the layers from max_window_layers on (or layer_types)
        window = raw.get("sliding_window", default_window) if _bool(raw, "use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first = raw.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise ConfigError(f"config field 'max_window_layers' must be an int >= 0, got {first!r}")
            sliding_layers = max(0, layers - first)
        else:
            kinds = ("full_attention", "sliding_attention")
            if not isinstance(layer_types, list) or len(layer_types) != layers or \
                    any(kind not in kinds for kind in layer_types):
                raise ConfigError(f"config field 'layer_types' must list {layers} of {kinds}, got {layer_types!r:.200}")
            sliding_layers = layer_types.count("sliding_attention")
    if window is None or not sliding_layers:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"config field 'sliding_window' must be a positive int or null, got {window!r}")
    if window < max_positions:
        where = "" if "sliding_window" in raw else f" (transformers' default for {raw['model_type']!r})"
        raise ConfigError(f"sliding_window {window}{where} is smaller than max_position_embeddings {max_positions}: "
                          f"{sliding_layers} layer(s) attend to a sliding window, which this implementation does "
                          "not run (a window of null or at least max_position_embeddings is accepted)")


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
