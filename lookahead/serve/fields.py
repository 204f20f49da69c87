"""Which of the API's request fields this server honours, and the checks of its free-form ones (the bodies themselves
are `protocol.py`'s pydantic models): the fields it cannot honour (`UNSUPPORTED`: accepted only at a neutral value),
the chat endpoint's own (`CHAT_ONLY`), those it ignores (`IGNORED`: none can change the answer), the chat template's
keywords the server sets itself (`TEMPLATE_OWN`), the limits on stop strings and the response formats.
"""

from __future__ import annotations

from typing import Any

from .errors import FieldError
from .tools import TOOL_NAME

MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 1024  # characters per stop string: each is matched on the engine's thread, every token

# fields OpenAI (or vLLM) defines that this server cannot honour: each is accepted only at a neutral value
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "the deprecated functions are not supported: give tools"),
    "function_call": (("none",), "the deprecated function_call is not supported: give tool_choice"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "presence_penalty": ((0, 0.0), "penalties are not supported (only 0)"),
    "frequency_penalty": ((0, 0.0), "penalties are not supported (only 0)"),
    "repetition_penalty": ((1, 1.0), "penalties are not supported (only 1)"),
    "min_p": ((0, 0.0), "min_p is not supported (only 0)"),
    "min_tokens": ((0,), "min_tokens is not supported (only 0)"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "store": ((False,), "stored completions are not supported"),
    "best_of": ((1,), "best_of > 1 is not supported (one sequence per request)"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "verbosity": (("medium",), "verbosity is not supported (only 'medium')"),
    "skip_special_tokens": ((True,), "only skip_special_tokens true is supported"),
    "spaces_between_special_tokens": ((True,), "only spaces_between_special_tokens true is supported"),
    "include_stop_str_in_output": ((False,), "include_stop_str_in_output is not supported (only false)"),
    "chat_template": ((), "a request's own chat_template is not supported (the model's is used)"),
    "continue_final_message": ((False,), "continue_final_message is not supported (only false)"),
    "typical_p": ((1, 1.0), "typical_p is not supported (only 1)"),
    "mirostat": ((0,), "mirostat is not supported (only 0)"),
}
# fields of the chat endpoint only
CHAT_ONLY = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# fields accepted at any value and ignored, since none changes the answer: the openai SDK's hints
# (prompt_cache_key, safety_identifier), and vLLM's and llama-server's scheduling and caching extras
IGNORED = ("prompt_cache_key", "safety_identifier", "cache_prompt", "priority", "request_id")
# chat_template_kwargs that the server sets itself
TEMPLATE_OWN = ("conversation", "messages", "tokenize", "return_dict", "return_tensors", "add_generation_prompt",
                "chat_template", "tools", "documents", "continue_final_message")


def check_supported(data: dict, chat: bool) -> None:
    """FieldError naming the first field of `data` (a body as it came) that this server cannot honour at its value:
    one of `UNSUPPORTED` at a value other than its neutral ones, or (`chat` False) one of the chat endpoint's own."""
    for name, (values, why) in UNSUPPORTED.items():
        if name in data and not _neutral(data[name], *values):
            raise FieldError(name, f"{name}: {why}; got {short(data[name])}")
    if not chat:
        for name, value in CHAT_ONLY.items():
            if not _neutral(data.get(name), value):
                raise FieldError(name, f"{name}: tool calling is for /v1/chat/completions; got {short(data[name])}")


def check_response_format(value: Any) -> dict | None:
    """None, {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "description", "strict"}}; the schema itself is the grammar engine's to judge (a 400 naming what it cannot
    compile)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"response_format: must be an object whose type is one of "
                         f"{', '.join(RESPONSE_FORMATS)}; got {short(value)}")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise FieldError("response_format", "response_format: unexpected field(s) "
                         f"{', '.join(extra) or 'json_schema'} for type {kind!r}")
    if kind != "json_schema":
        return value
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("response_format.json_schema", "response_format.json_schema: an object with the schema "
                         f"is required for type 'json_schema'; got {short(spec)}")
    unknown = sorted(set(spec) - {"name", "schema", "description", "strict"})
    if unknown:
        raise FieldError(f"response_format.json_schema.{unknown[0]}", "response_format.json_schema: unknown "
                         f"field(s) {', '.join(unknown)}")
    if not isinstance(spec.get("name"), str) or not TOOL_NAME.fullmatch(spec["name"]):
        raise FieldError("response_format.json_schema.name", "response_format.json_schema.name: required, 1-64 "
                         f"letters, digits, '_' or '-'; got {short(spec.get('name'))}")
    if not isinstance(spec.get("schema", {}), dict):
        raise FieldError("response_format.json_schema.schema", "response_format.json_schema.schema: must be a "
                         f"JSON schema (an object); got {short(spec.get('schema'))}")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise FieldError("response_format.json_schema.strict", "response_format.json_schema.strict: must be a "
                         f"boolean; got {short(spec['strict'])}")
    return value


def check_stops(value: Any) -> tuple[str, ...]:
    """`stop`: a string or a list of at most `MAX_STOPS` non-empty strings of at most `MAX_STOP_CHARS` characters each,
    as a tuple (ValueError otherwise)."""
    stops = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"must be a string or a list of strings, got {short(value)}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("a stop string must not be empty")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters, got one of {longest}")
    return tuple(stops)


def _neutral(value: Any, *neutral: Any) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in neutral)


def short(value: Any, limit: int = 60) -> str:
    """A value as an error message shows it: its repr, cut at `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
