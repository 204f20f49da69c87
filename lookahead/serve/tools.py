"""Tool calls for models whose chat template has no tool format of its own (SmolLM2's, the tiny test model's): the
tools are described in a system message and the answer is one JSON object, constrained by a grammar built from the
tools' parameter schemas, as llama.cpp's server does for such templates ("generic" format) and vLLM does for
`tool_choice` "required" or a named function:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}    a call (several: parallel calls)
    {"response": "Hello!"}                                                        a plain answer (tool_choice "auto")

`tool_choice` "required" allows the first form only, a named function the first form with that function once, "auto"
either, "none" no tools at all (the request is answered as if it had none). `parse_answer` turns the answer back into
OpenAI's `tool_calls` (ids `call_...`, arguments as a JSON string) or content.
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
    """How a request may use its tools: `tools` (checked), the choice ("auto", "required" or a function's name) and
    whether several calls may come at once."""

    tools: list[dict]
    choice: str
    parallel: bool

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolMode | None:
        """None where the request has no tools or tool_choice is "none"."""
        if not tools or tool_choice == "none":
            return None
        choice = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else tool_choice or "auto"
        return cls(tools, choice, parallel is not False and choice in ("auto", "required"))

    def schema(self) -> dict:
        """The JSON schema the answer follows."""
        tools = [t for t in self.tools if self.choice in ("auto", "required", t["name"])]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
        if not self.parallel:
            calls["maxItems"] = 1
        call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}
        if self.choice != "auto":
            return call
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return {"anyOf": [call, answer]}

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
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


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


def parse_answer(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an answer in the format above: OpenAI's tool_calls with fresh ids, or the response's
    text; an answer that is not one (cut by the token limit) is returned as content."""
    try:
        answer = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(answer, dict) and isinstance(answer.get("tool_calls"), list):
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
                 for call in answer["tool_calls"]]
        return None, calls
    if isinstance(answer, dict) and isinstance(answer.get("response"), str):
        return answer["response"], None
    return text, None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
