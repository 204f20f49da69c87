"""One request in the engine, seen from the asyncio loop: submitted with its text stream as the stop-string matcher,
its deltas turned into text on the engine's thread and handed to the loop, cancelled when its client goes.

The engine calls `stops_at` and the sink on its own thread. Both are guarded here: an exception in them would fail
every row of the step, so a failure ends this request alone (as an error) and the engine goes on. Text is decoded
with a tokenizer of the engine thread's own (a copy): a fast tokenizer must not be used from two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from lookahead.loop import Delta, Engine, GenerationResult, TokenLogprob
from lookahead.request import Request

from .metrics import Metrics
from .text import TextStream

log = logging.getLogger("lookahead.serve")


@dataclass(frozen=True)
class Event:
    """What the handler gets for each engine delta: the text that may go out now (held back: an incomplete character,
    a possible start of a stop string), the delta's log-probabilities, and on the last one the engine's finish reason
    ("stop", "length", "cancelled", "error"), the result and the error."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: str | None = None


class Submission:
    """Submit a `Request` of one prompt to the engine (from the asyncio loop); iterate `events()` for its `Event`s,
    `cancel()` to end it at the next step boundary. Raises what `Engine.submit` raises (ValueError, QueueFull)."""

    def __init__(self, engine: Engine, tokenizer, metrics: Metrics, request: Request, *, stop: Sequence[str],
                 logprobs: int | None, arrival: float, grammar=None) -> None:
        self.loop = asyncio.get_running_loop()
        self.metrics, self.prompt_tokens, self.arrival = metrics, len(request.prompts[0]), arrival
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.text = TextStream(tokenizer, stop)
        self.received = 0  # tokens the sink has had
        self.first_token_s: float | None = None
        self.failure: str | None = None
        self.grammar, self.grammar_failed = grammar, False  # the grammar failed (its `error`): the schema's fault
        self.finished = False
        self.handle = None
        self.handle = engine.submit(request, stops_at=self._stops_at if stop else None, logprobs=logprobs,
                                    sink=self._sink, grammar=grammar)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events as the engine decides them; the last has a finish reason."""
        while True:
            event = await self.queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        """End the request at the next step boundary (its row leaves; it finishes as "cancelled")."""
        if not self.finished and self.handle is not None:
            self.handle.cancel()

    # ----- on the engine's thread -----

    def _stops_at(self, token: int) -> bool:
        try:
            return self.text.feed(token)
        except Exception as e:  # noqa: BLE001 -- this request ends, as an error; the engine's other rows go on
            self._fail(e)
            return True

    def _sink(self, delta: Delta) -> None:
        final = delta.finish_reason is not None
        try:
            event = self._event(delta)
        except Exception as e:  # noqa: BLE001 -- as in _stops_at
            self._fail(e)
            event = Event("", None, delta.finish_reason, delta.result, delta.error)
        if not final and self.failure is not None:
            return  # failed: only the last delta goes on, as an error
        if final:
            self.finished = True
            grammar_error = getattr(self.grammar, "error", None)
            if self.failure is None and grammar_error is not None:  # (its mask let only a stop token follow)
                self.grammar_failed, self.failure = True, grammar_error
            if self.failure is not None:
                event = Event(event.text, event.logprobs, "error", delta.result, self.failure)
            try:
                self.metrics.request_finished(delta.result, self.prompt_tokens, event.finish_reason,
                                              time.perf_counter() - self.arrival, self.first_token_s)
            except Exception:  # noqa: BLE001 -- a metric is not worth the request
                log.exception("recording a finished request's metrics failed")
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed (the server is gone): nobody is waiting
            pass

    def _event(self, delta: Delta) -> Event:
        self.received += len(delta.tokens)
        unseen = self.received - len(self.text.tokens)  # tokens `stops_at` did not see: a stop token (or all)
        for token in delta.tokens[len(delta.tokens) - unseen :] if unseen > 0 else ():
            self.text.feed(token)
        if delta.tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.arrival
            self.metrics.ttft.observe(self.first_token_s)
        return Event(self.text.take(delta.finish_reason is not None), delta.logprobs, delta.finish_reason,
                     delta.result, delta.error)

    def _fail(self, error: Exception) -> None:
        if self.failure is None:
            log.error("request failed while decoding its text", exc_info=error)
            self.failure = f"decoding the output text failed: {type(error).__name__}: {error}"
            if self.handle is not None:
                self.handle.cancel()
