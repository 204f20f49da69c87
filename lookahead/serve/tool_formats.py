"""Tool calls in a chat template's own format, where it has one: the template is given the tools (`tools=`), the
conversation's earlier calls and results as it expects them, and the answer is held by a grammar to the form the
template taught the model, then read back into OpenAI's `tool_calls`. Two formats are known, told apart by the
template's text (`detect`):

    hermes       <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
                 (Qwen2.5, Hermes and the many templates that mention `<tool_call>`); parallel calls: one block each,
                 separated by a newline
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}
                 (Llama 3.1/3.2: a template that asks for "parameters" JSON and has the `ipython` role); one call
                 always, as its template renders no more

Any other template gets `lookahead.serve.tools`' generic format, unchanged. The guarantees are the generic one's: with
tool_choice "required" or a named function the answer is calls only, with "auto" calls or plain text (text that
never takes the call form, so it streams as it comes); one call unless `parallel_tool_calls` is true, then at most
`MAX_CALLS`, an identical call returned once; cut by the token limit, the calls complete before the cut.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from lookahead.structured import JSON_STYLE

from .tools import MAX_CALLS, ToolMode, arguments_schema, fold_tool_results, openai_calls


@dataclass(frozen=True)
class TemplateFormat:
    """A template's tool-call form: `opening` (how an answer of calls begins, and what plain text may never hold:
    `text_rule`), the key of a call's arguments, what comes `before` and `after` each call's JSON and between calls,
    and whether a call list may hold more than one."""

    name: str
    opening: str
    arguments_key: str
    before: str
    after: str
    separator: str
    several: bool
    text_rule: str  # a Lark regex of what plain text may not match

    def grammar(self, mode: ToolMode) -> str:
        """The Lark grammar (llguidance's) of an answer under `mode`: calls of the offered tools (each call's JSON
        compact, its arguments its tool's parameters), a list that ends; or, with "auto" (and "text"), plain text."""
        calls = [self._call_rule(tool) for tool in mode.offered()]
        most = MAX_CALLS if mode.parallel and self.several else 1
        lines = ["%llguidance {}"]
        if mode.choice == "text":
            lines.append("start: TEXT")
        else:
            lines.append("start: calls | TEXT" if mode.choice == "auto" else "start: calls")
            repeat = f"({_lark_string(self.separator)} call){{0,{most - 1}}}" if most > 1 else ""
            lines += [f"calls: call {repeat}".rstrip(), "call: " + " | ".join(calls)]
        lines.append(f"TEXT: /(?s:.+)/ & ~/{self.text_rule}/")
        return "\n".join(lines) + "\n"

    def _call_rule(self, tool: dict) -> str:
        key = self.arguments_key
        schema = {"x-guidance": JSON_STYLE, "type": "object", "properties": {
            "name": {"const": tool["name"]}, key: arguments_schema(tool, f"#/properties/{key}")},
            "required": ["name", key], "additionalProperties": False}
        parts = [_lark_string(self.before)] if self.before else []
        parts.append("%json " + json.dumps(schema, ensure_ascii=False))
        if self.after:
            parts.append(_lark_string(self.after))
        return " ".join(parts)

    def parse(self, text: str) -> list[dict]:
        """The complete calls ({"name", "arguments"}) of an answer of calls, in order (before a cut, where cut)."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while text.startswith(self.before, at):
            try:
                call, at = decoder.raw_decode(text, at + len(self.before))
            except ValueError:
                break
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and self.arguments_key in call):
                break
            calls.append({"name": call["name"], "arguments": call[self.arguments_key]})
            if not text.startswith(self.after + self.separator, at):
                break
            at += len(self.after + self.separator)
        return calls

    def reader(self) -> FormatReader:
        return FormatReader(self)


HERMES = TemplateFormat("hermes", "<tool_call>", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", True,
                        r"(?s:.*<tool_call>.*)")
LLAMA3_JSON = TemplateFormat("llama3_json", "{", "parameters", "", "", "; ", False, r"(?s:\s*\{.*)")
_LLAMA3_TOOLS = re.compile(r"""["']?parameters["']?\s*:""")


def detect(template: Any) -> TemplateFormat | None:
    """The tool format a chat template (its text; a dict of named templates is read whole) has, None for none."""
    text = str(template or "")
    if "<tool_call>" in text:
        return HERMES
    if "ipython" in text and "tools" in text and _LLAMA3_TOOLS.search(text):
        return LLAMA3_JSON
    return None


def template_input(template: Any, messages: list, tools: ToolMode | None) -> tuple[list[dict], dict]:
    """The conversation (`protocol.ChatMessage`s) as the chat template reads it, and the arguments it takes beside
    it: with a format of its own (`detect`), assistants' calls as `tool_calls` (arguments parsed), tool results as
    `role: tool`, and the tools as `tools=`; otherwise the generic format's messages (`lookahead.serve.tools`)."""
    names = {call.id: call.function.name for message in messages for call in message.tool_calls or ()}
    if detect(template) is None:
        out = fold_tool_results([message.for_template(names) for message in messages], template)
        return (tools.messages(out) if tools is not None else out), {}
    out = []
    for message in messages:
        if not message.tool_calls:
            out.append(message.for_template(names))
            continue
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": _parsed(c.function.arguments)}}
                 for c in message.tool_calls]
        out.append({"role": "assistant", "content": message.content or "", "tool_calls": calls})
    if tools is None:
        return out, {}
    listed = [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in tools.tools]
    return out, {"tools": listed}


class FormatReader:
    """An answer in a template's format, read as it arrives (`AnswerReader`'s interface): plain text is handed out
    as it comes once it cannot be the start of a call; calls when the answer ends, those complete before a cut."""

    def __init__(self, format: TemplateFormat) -> None:
        self.format = format
        self.text = ""
        self._sent = 0  # characters of plain text handed out

    def _undecided(self) -> bool:
        return self.format.opening.startswith(self.text)

    def _is_calls(self) -> bool:
        return self.text.startswith(self.format.opening)

    def feed(self, piece: str) -> str:
        self.text += piece
        if self._undecided() or self._is_calls():
            return ""
        out, self._sent = self.text[self._sent :], len(self.text)
        return out

    def calls(self) -> list[dict] | None:
        return self.finish()[1] if self._is_calls() else None

    def finish(self) -> tuple[str | None, list[dict] | None]:
        if self._is_calls():
            calls = openai_calls(self.format.parse(self.text))
            return (None, calls) if calls else ("", None)
        if self._undecided():  # cut before either form showed
            return "", None
        return self.feed(""), None


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _lark_string(text: str) -> str:
    return json.dumps(text)  # (a JSON string is a Lark string: the same escapes)
