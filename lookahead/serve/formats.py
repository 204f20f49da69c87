"""The response objects of the two generating endpoints, whole and streamed: `chat.completion` and its chunks
(`ChatFormat`, with tool calls read out of the answer), `text_completion` (`CompletionFormat`), and OpenAI's `usage`."""

from __future__ import annotations

import time
import uuid

from lookahead.loop import TokenLogprob

from .protocol import ChatCompletionRequest, CompletionRequest
from .tools import ToolMode


def usage(result, prompt_tokens: int) -> dict:
    """OpenAI's usage, with the cached prompt tokens and the forward passes (S = tokens per forward pass)."""
    tokens = len(result.tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "lookahead": {"steps": result.steps, "compression": round(result.compression, 4)}}


class ChatFormat:
    """`chat.completion` and `chat.completion.chunk` objects. With tools, the answer (`lookahead.serve.tools`) becomes
    `tool_calls` (finish_reason "tool_calls"; on "length" the calls complete before the cut) or content; streamed, a
    plain answer's text goes out as it comes, the calls whole in the last chunk."""

    def __init__(self, served, body: ChatCompletionRequest, tools: ToolMode | None = None) -> None:
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served.model_name
        self.token_text = served.token_text
        self.tools = tools
        self.reader = tools.reader() if tools is not None else None  # with tools: reads the answer as it comes

    def _object(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def start(self) -> list[dict]:
        return [self._object("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])]

    def chunk(self, text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict | None:
        delta = {"content": text} if text or not finish else {}
        if self.reader is not None:
            content, calls = self.reader.feed(text), None
            if finish is not None:
                rest, calls = self.reader.finish()
                content += rest or ""
            if calls:
                delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                finish = "tool_calls" if finish == "stop" else finish
            elif content or finish is not None:
                delta = {"content": content} if content else {}
            else:
                return None
            logprobs = []
        return self._object("chat.completion.chunk", [
            {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs) if logprobs else None,
             "finish_reason": finish}])

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object("chat.completion.chunk", []), "usage": usage}

    def repeats(self, text: str | None = None) -> bool:
        """Whether the answer (`text`; None: the one streamed so far, whole) only repeats calls answered already."""
        if self.reader is None:
            return False
        reader = self.reader
        if text is not None:
            reader = self.tools.reader()
            reader.feed(text)
        return self.tools.repeats(reader.calls())

    def restart(self) -> None:
        """Read a new answer (the request is answered again)."""
        self.reader = self.tools.reader()

    def response(self, text: str, logprobs: list[TokenLogprob] | None, finish: str, usage: dict) -> dict:
        message = {"role": "assistant", "content": text}
        if self.reader is not None:
            content = self.reader.feed(text)
            rest, calls = self.reader.finish()
            message = {"role": "assistant", "content": None if calls else content + (rest or "")}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message,
                  "logprobs": self._logprobs(logprobs) if logprobs else None, "finish_reason": finish}
        return {**self._object("chat.completion", [choice]), "usage": usage}

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text, data = self.token_text(token)
            return {"token": text, "logprob": max(logprob, -9999.0), "bytes": data}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in logprobs], "refusal": None}


class CompletionFormat:
    """`text_completion` objects, streamed or not; logprobs in the legacy shape (tokens, token_logprobs,
    top_logprobs, text_offset)."""

    def __init__(self, served, body: CompletionRequest) -> None:
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served.model_name
        self.token_text = served.token_text
        self.offset = 0  # text_offset of the next token

    def _object(self, choices: list) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def start(self) -> list[dict]:
        return []

    def chunk(self, text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict:
        return self._object([{"index": 0, "text": text, "logprobs": self._logprobs(logprobs) if logprobs else None,
                              "finish_reason": finish}])

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object([]), "usage": usage}

    def response(self, text: str, logprobs: list[TokenLogprob] | None, finish: str, usage: dict) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish}
        return {**self._object([choice]), "usage": usage}

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for lp in logprobs:
            text = self.token_text(lp.token)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [max(lp.logprob, -9999.0) for lp in logprobs],
                "top_logprobs": [{self.token_text(t)[0]: max(p, -9999.0) for t, p in lp.top} for lp in logprobs],
                "text_offset": offsets}
