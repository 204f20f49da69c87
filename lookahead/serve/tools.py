"""Tool calls for models whose chat template has no tool format of its own (SmolLM2's, the tiny test model's; a
template with one, Qwen2.5's `<tool_call>` or Llama 3.1's JSON, is `tool_formats`' and reuses `ToolMode`): the
tools are described in a system message and the answer is one JSON object, constrained by a grammar built from the
tools' parameter schemas, as llama.cpp's server does for such templates ("generic" format) and vLLM does for
`tool_choice` "required" or a named function:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}    a call (several: parallel calls)
    {"response": "Hello!"}                                                        a plain answer (tool_choice "auto")

`tool_choice` "required" allows the first form only, a named function the first form with that function once, "auto"
either, "none" no tools at all (the request is answered as if it had none). One call unless the request sets
`parallel_tool_calls` true (llama.cpp's server's default: a small model asked for a list repeats its call until the
token limit), then at most `MAX_CALLS`, an identical call kept once (a repeat is a loop, not a parallel call): the
grammar ends the answer either way. `AnswerReader` turns the answer back into OpenAI's `tool_calls` (ids `call_...`,
arguments as a JSON string) or content, as it arrives: a plain answer's text streams, and an answer cut by the token
limit gives the calls complete before the cut (never the wrapper as content).

`fold_tool_results`: for a chat template with no tool role of its own (SmolLM2's, ChatML's plain loop), a `role: tool`
message becomes a user message that says it is a tool's result, which the model was trained to read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import FieldError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's (and a json_schema's) name
TOOL_CHOICES = ("none", "auto", "required")
CALL_FORM = '{"tool_calls": [{"name": ..., "arguments": {...}}]}'
MAX_CALLS = 8  # calls in one answer at most with parallel_tool_calls true
CALLS_OPEN = '{"tool_calls": ['  # how an answer of calls begins (the grammar writes compact JSON: `structured.py`)
RESPONSE_OPEN = '{"response": "'  # how a plain answer begins
_TEMPLATE_TOOL_ROLE = re.compile(r"""['"](tool|ipython)['"]""")  # a template that tests for the tool role


def check_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
    """The request's tools as [{"name", "description", "parameters"}], each checked; FieldError naming the field
    (tools[1].function.parameters) otherwise. tool_choice is checked against them."""
    if tools is None or tools == []:
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise FieldError("tool_choice", f"tool_choice: {_short(tool_choice)} needs tools; none are given")
        _check_choice(tool_choice, [])
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", f"tools: must be a list of tools, got {_short(tools)}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f"{where}.type", f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are "
                             f"supported, got {_short(tool)}")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise FieldError(f"{where}.{unknown[0]}", f"{where}: unknown field(s) {', '.join(unknown)}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise FieldError(f"{where}.function", f"{where}.function: required, an object; got {_short(function)}")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise FieldError(f"{where}.function.{unknown[0]}", f"{where}.function: unknown field(s) "
                             f"{', '.join(unknown)}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name", f"{where}.function.name: required, 1-64 letters, digits, '_' "
                             f"or '-'; got {_short(name)}")
        if any(t["name"] == name for t in out):
            raise FieldError(f"{where}.function.name", f"{where}.function.name: {name!r} is given twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise FieldError(f"{where}.function.description", f"{where}.function.description: must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise FieldError(f"{where}.function.parameters", f"{where}.function.parameters: must be a JSON schema of "
                             f"an object; got {_short(parameters)}")
        out.append({"name": name, "description": description, "parameters": parameters})
    _check_choice(tool_choice, [t["name"] for t in out])
    return out


def _check_choice(choice: Any, names: list[str]) -> None:
    if choice is None or choice in TOOL_CHOICES:
        return
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return
        raise FieldError("tool_choice.function.name", f"tool_choice.function.name: {_short(name)} is not one of the "
                         f"tools ({', '.join(names) or 'none given'})")
    raise FieldError("tool_choice", "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', "
                     f"'function': {{'name': ...}}}}; got {_short(choice)}")


@dataclass(frozen=True)
class ToolMode:
    """How a request may use its tools: `tools` (checked), the choice ("auto", "required", a function's name, or
    "text": a plain answer only), whether several calls may come at once, and the calls the conversation made and
    had answered already (`call_key`s): with "auto", an answer that only repeats them is a loop, answered in text
    instead (`repeats`, `text_only`)."""

    tools: list[dict]
    choice: str
    parallel: bool
    answered: frozenset[str] = frozenset()
    format: Any = None  # the chat template's own tool format (`tool_formats.TemplateFormat`); None: this module's

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
           answered: frozenset[str] = frozenset(), format: Any = None) -> ToolMode | None:
        """None where the request has no tools or tool_choice is "none". Several calls only where the request asks
        for them (`parallel_tool_calls` true), as llama.cpp's server has it."""
        if not tools or tool_choice == "none":
            return None
        choice = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else tool_choice or "auto"
        return cls(tools, choice, parallel is True and choice in ("auto", "required"), answered, format)

    def repeats(self, calls: list[dict] | None) -> bool:
        """Whether an answer's `calls` (OpenAI's shape) only repeat calls answered already, where a plain answer was
        allowed: the model loops (a small one calls again after every result)."""
        return (self.choice == "auto" and bool(calls)
                and all(call_key(c["function"]["name"], c["function"]["arguments"]) in self.answered for c in calls))

    def text_only(self) -> ToolMode:
        return ToolMode(self.tools, "text", False, self.answered, self.format)

    def offered(self) -> list[dict]:
        """The tools the answer may call (all, or the one tool_choice names)."""
        return [t for t in self.tools if self.choice in ("auto", "required", t["name"])]

    def reader(self):
        """A reader of one answer (`AnswerReader`, or the template format's)."""
        return AnswerReader() if self.format is None else self.format.reader()

    def schema(self) -> dict | str:
        """The JSON schema the answer follows: a list of calls that ends (one, or at most MAX_CALLS). Each tool's
        parameters are a definition of their own (`$defs`), their own `$ref`s ("#/$defs/...", "#") pointed at it;
        the arguments hold the parameters' properties only, unless the parameters say otherwise
        (`additionalProperties`): a small model let add keys adds them until the token limit. With a template's own
        format, its grammar (Lark text, `tool_formats`)."""
        if self.format is not None:
            return self.format.grammar(self)
        tools = self.offered()
        calls = {"type": "array", "minItems": 1, "maxItems": MAX_CALLS if self.parallel else 1,
                 "items": {"anyOf": [_call_schema(t) for t in tools]}}
        call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}
        defs = {f"tool_{t['name']}": arguments_schema(t, f"#/$defs/tool_{t['name']}") for t in tools}
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        if self.choice == "text":
            return answer
        if self.choice != "auto":
            return {**call, "$defs": defs}
        return {"anyOf": [call, answer], "$defs": defs}

    def instructions(self) -> str:
        """The system message's part that tells the model its tools and how to answer."""
        listed = json.dumps([{k: v for k, v in t.items() if v is not None} for t in self.tools], ensure_ascii=False)
        text = f"Tools: {listed}\nTo call tools, answer in JSON: " + CALL_FORM
        if self.choice == "auto":
            text += '; to answer without one: {"response": "..."}'
        elif self.choice != "required":
            text += f"; call {self.choice}"
        return text

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation with the instructions in its system message (added first where it has none)."""
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.instructions()}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.instructions()}, *messages]


def _call_schema(tool: dict) -> dict:
    arguments = {"$ref": f"#/$defs/tool_{tool['name']}"}
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def arguments_schema(tool: dict, base: str) -> dict:
    """A tool's arguments' schema placed at `base` (its `$ref`s pointed there), no keys beyond its properties unless
    its parameters say otherwise."""
    return _rooted({"additionalProperties": False, **tool["parameters"]}, base)


def _rooted(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#...", relative to its own root) made relative to `base`."""
    if isinstance(schema, list):
        return [_rooted(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rooted(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def call_key(name: str, arguments: str) -> str:
    """A call as compared for repeats: its name and its arguments parsed (so spacing does not count)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return json.dumps([name, parsed], sort_keys=True, ensure_ascii=False)


def answered_calls(messages: list) -> frozenset[str]:
    """The `call_key`s of a conversation's tool calls (`protocol.ChatMessage`s) that a tool message answers."""
    answers = {m.tool_call_id for m in messages if m.role == "tool"}
    return frozenset(call_key(c.function.name, c.function.arguments) for m in messages for c in m.tool_calls or ()
                     if c.id in answers)


def calls_text(calls: list[tuple[str, str]]) -> str:
    """An earlier assistant message's tool calls (name, arguments as a JSON string) as the answer that made them."""
    out = []
    for name, arguments in calls:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = arguments
        out.append({"name": name, "arguments": parsed})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def fold_tool_results(messages: list[dict], template: Any) -> list[dict]:
    """`messages` (as templates read them; a tool message with its `tool_call_id` and the call's `name`) for a chat
    template: unchanged where the template knows a tool role, else each run of tool messages becomes one user message
    (the templates that insist on turns alternate), each result on a line "Tool result of NAME: ..."."""
    if _TEMPLATE_TOOL_ROLE.search(str(template or "")):
        return messages
    out: list[dict] = []
    for message in messages:
        if message["role"] != "tool":
            out.append(message)
            continue
        text = f"Tool result{' of ' + message['name'] if message.get('name') else ''}: {message['content']}"
        if out and out[-1].get("tool_results"):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{text}"}
        else:
            out.append({"role": "user", "content": text, "tool_results": True})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


class AnswerReader:
    """An answer in the format above, read as its text arrives (`feed`, then `finish`): a plain answer's text is
    handed out as it comes; calls when the answer ends, those complete before a cut on "length". Text not in the
    format (none should come: the grammar holds the model to it) is content."""

    def __init__(self) -> None:
        self.text = ""
        self._sent = 0  # characters of a plain answer's JSON string handed out (decoded)

    def feed(self, piece: str) -> str:
        """The answer's next text; returns the plain answer's text that may go out now ("" for calls)."""
        self.text += piece
        if not self.text.startswith(RESPONSE_OPEN):
            return ""
        raw = self.text[len(RESPONSE_OPEN):]
        end = _string_end(raw, self._sent)
        try:
            out = json.loads(f'"{raw[self._sent : end]}"')
        except ValueError:  # (not JSON as the grammar writes it: left to `finish`)
            return ""
        self._sent = end
        return out

    def calls(self) -> list[dict] | None:
        """The answer's calls so far, complete ones (OpenAI's shape); None for a plain answer or none."""
        return None if self.text.startswith(RESPONSE_OPEN) else self.finish()[1]

    def finish(self) -> tuple[str | None, list[dict] | None]:
        """(content not handed out yet, tool_calls): OpenAI's tool_calls with fresh ids, an identical call once."""
        if self.text.startswith(RESPONSE_OPEN):
            return self.feed(""), None
        if self.text.startswith(CALLS_OPEN[:2]) and CALLS_OPEN.startswith(self.text[: len(CALLS_OPEN)]):
            calls = openai_calls(_complete_calls(self.text))
            return (None, calls) if calls else ("", None)
        if self.text.startswith(RESPONSE_OPEN[: len(self.text)]):  # cut before either form showed
            return "", None
        return self.text, None


def openai_calls(calls: list[dict]) -> list[dict]:
    """Calls as read ({"name", "arguments": a JSON value}) in OpenAI's shape, fresh ids, an identical call once."""
    out, seen = [], set()
    for call in calls:
        key = json.dumps(call, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
                "name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    return out


def parse_answer(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a whole answer (`AnswerReader`)."""
    reader = AnswerReader()
    content = reader.feed(text)
    rest, calls = reader.finish()
    return (None, calls) if calls else (content + (rest or ""), None)


def _complete_calls(text: str) -> list[dict]:
    """The calls of an answer of calls that are complete (all of them; before the cut, where it was cut)."""
    decoder, calls, at = json.JSONDecoder(), [], len(CALLS_OPEN)
    while at < len(text):
        try:
            call, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
            calls.append(call)
        if not text.startswith(", ", at):
            break
        at += 2
    return calls


def _string_end(raw: str, start: int) -> int:
    """Where the part of a JSON string's text `raw` (from `start`) that decodes on its own ends: before its closing
    quote, or before an escape not yet whole (a high surrogate waits for its pair)."""
    i = start
    while i < len(raw):
        char = raw[i]
        if char == '"':
            return i
        if char != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            return i
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            return i
        if raw[i + 2 : i + 4].lower() in ("d8", "d9", "da", "db"):  # a pair's first half: decoded with its second
            if len(raw) < i + 8 or (raw.startswith("\\u", i + 6) and len(raw) < i + 12):
                return i
            i += 12 if raw.startswith("\\u", i + 6) else 6
            continue
        i += 6
    return i


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
