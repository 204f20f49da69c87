"""The request bodies of `POST /v1/chat/completions` and `POST /v1/completions`, as the OpenAI API defines them,
checked by pydantic before the engine sees them.

Strict: a field of the wrong type is refused, not coerced ("10" is not a number of tokens), numbers must be finite,
and a field this server does not know is refused as OpenAI refuses it ("Unrecognized request argument"). A field it
knows but cannot honour (tools, logit_bias, a penalty, best_of > 1, echo, ...) is accepted at its neutral value and
refused, naming it, at any other. A field that cannot change the answer (a cache or safety hint: `IGNORED`) is
accepted and ignored, and the server logs it once. Accepted beside OpenAI's fields, as vLLM and llama-server accept
them: `top_k` (-1 or 0: off), `ignore_eos`, `stop_token_ids`, `n_predict` (llama-server's max_tokens; -1: what
remains), and for chat `add_generation_prompt` and `chat_template_kwargs` (passed to the chat template, e.g. Qwen3's
`enable_thinking`).

Defaults: the model's generation_config.json's temperature, top_p and top_k where it sets them (as vLLM does),
else OpenAI's, temperature 1 and top_p 1 (temperature 0 is greedy); `max_tokens` is what remains of the model's
positions for a chat completion and 16 for a completion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lookahead.loop import MAX_LOGPROBS
from lookahead.request import SEED_SPAN, SamplingParams

from .errors import FieldError
from .fields import IGNORED, TEMPLATE_OWN, check_response_format, check_stops, check_supported, short
from .tools import calls_text, check_tools

COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Generation(_Body):
    """What both endpoints share: the model, the limits, the sampling, the stops, the stream."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=SEED_SPAN)  # a negative seed s is s mod 2**64
    stop: Any = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    n_predict: int | None = Field(None, ge=-1)
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    response_format: Any = None  # checked by `_response_format`
    tools: Any = None  # chat only (CHAT_ONLY), checked by ChatCompletionRequest
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # accepted at their neutral values only (UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    store: Any = None
    verbosity: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    typical_p: Any = None
    mirostat: Any = None
    # accepted at any value and ignored (IGNORED)
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    cache_prompt: Any = None
    priority: Any = None
    request_id: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_supported({k: v for k, v in data.items() if k in cls.model_fields}, cls is ChatCompletionRequest)
        return data

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> dict | None:
        return check_response_format(value)

    @property
    def json_schema(self) -> dict | None:
        """The schema the output must follow: the json_schema's (an empty one: any JSON), {"type": "object"} for
        json_object; None: free text."""
        kind = (self.response_format or {}).get("type")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            return self.response_format["json_schema"].get("schema") or {}
        return None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return check_stops(value)

    @model_validator(mode="after")
    def _check_together(self):
        if self.n is not None and self.n != 1:
            raise FieldError("n", f"n: only n=1 is supported (one choice per request), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options: only allowed when stream is true")
        if self.n_predict == 0:
            raise FieldError("n_predict", "n_predict: must be >= 1, or -1 for what remains of the context; got 0")
        if self.n_predict is not None and self.max_tokens is not None and self.n_predict != self.max_tokens:
            raise FieldError("n_predict", f"n_predict ({self.n_predict}) and max_tokens ({self.max_tokens}) disagree; "
                             "give one of them")
        return self

    @property
    def ignored(self) -> list[str]:
        """The fields given that the server ignores (they cannot change the answer)."""
        return [name for name in IGNORED if getattr(self, name) is not None]

    @property
    def max_new_tokens(self) -> int | None:
        """The new tokens asked for, by the one name they carry past the body (`Request.max_new_tokens`, the engine's
        stop): max_tokens, or llama-server's n_predict (-1: none given); None: what remains of the model's positions.
        `max_new_tokens_param` names the field that gave it."""
        if self.max_tokens is not None or self.n_predict is None:
            return self.max_tokens
        return None if self.n_predict == -1 else self.n_predict

    @property
    def max_new_tokens_param(self) -> str:
        return "n_predict" if self.max_tokens is None and self.n_predict is not None else "max_tokens"

    # ----- what the engine is asked for -----

    def sampling(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The request's sampling; what it leaves unset from `defaults` (the model's generation_config), else
        OpenAI's: temperature 1, top_p 1. Temperature 0 is greedy; top_k -1 or 0 is off."""
        defaults = defaults or {}
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        top_p = self.top_p if self.top_p is not None else defaults.get("top_p", 1.0)
        top_k = self.top_k if self.top_k is not None else defaults.get("top_k", 0)
        return SamplingParams(float(temperature), max(top_k, 0), float(top_p))

    def engine_seed(self) -> int | None:
        """The seed for the engine, in [0, 2**64)."""
        return None if self.seed is None else self.seed % SEED_SPAN

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    """A tool call of an earlier assistant message, as the API returned it."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Body):
    """One message. content: a string or a list of text parts (joined with newlines, as vLLM joins them). An assistant
    message may hold tool_calls instead of content; a tool message answers one (tool_call_id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of text parts, got {short(value)}")
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                                 f"got {short(kind)}")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message holds them, not a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the tool call it answers")
        return self

    def for_template(self, call_names: Mapping[str, str] | None = None) -> dict:
        """The message as chat templates read it ("developer" is OpenAI's newer name for "system"); an assistant's
        tool calls are written as the answer that made them (`lookahead.serve.tools`); a tool message keeps its
        `tool_call_id`, and the called function's name from `call_names` (call id -> name) where it has none."""
        content = self.content
        if self.tool_calls:
            content = calls_text([(call.function.name, call.function.arguments) for call in self.tool_calls])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        name = self.name
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            name = name if name is not None else (call_names or {}).get(self.tool_call_id)
        if name is not None:
            message["name"] = name
        return message


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    reasoning_effort: Any = None
    web_search_options: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None
    continue_final_message: Any = None

    @model_validator(mode="after")
    def _check_tools(self):
        self.tools = check_tools(self.tools, self.tool_choice)
        return self

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs: needs logprobs set to true")
        for name in ("reasoning_effort", "web_search_options"):
            if getattr(self, name) is not None:
                raise FieldError(name, f"{name}: not supported by this model server")
        own = sorted(set(self.chat_template_kwargs or ()) & set(TEMPLATE_OWN))
        if own:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs: {', '.join(own)} cannot be set here (the "
                             "server sets them; add_generation_prompt is a field of its own)")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens over the older max_tokens (or n_predict); None: what remains."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else super().max_new_tokens

    @property
    def max_new_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else super().max_new_tokens_param

    @property
    def engine_logprobs(self) -> int | None:
        """The engine's logprobs: top alternatives per token (0: the chosen token's only), None: none."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    """prompt: a string or a list of token ids (one prompt; a list of several is refused: n is 1)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            raise ValueError(f"holds {len(value)} prompts; this server answers one prompt per request (n=1): send "
                             "one request each")
        if isinstance(value, list) and not value:
            raise ValueError("is empty; give a string or a list of token ids")
        raise ValueError(f"must be a string or a list of token ids, got {short(value)}")

    @property
    def max_new_tokens(self) -> int | None:
        """max_tokens (or n_predict); 16 when none is given; None: n_predict -1, what remains."""
        if self.n_predict == -1 and self.max_tokens is None:
            return None
        asked = super().max_new_tokens
        return COMPLETION_MAX_TOKENS if asked is None else asked

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

