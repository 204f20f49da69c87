"""The two generating endpoints, translated: a checked body becomes a prompt's token ids and one engine submission;
the submission's events become OpenAI's response (`chat.completion`, `text_completion`) or its stream of chunks
(server-sent events: `data: {...}`, then `data: [DONE]`).

A client that goes away ends its request: a stream's response cancels the submission when it ends for any reason
(its client disconnected, a send failed), and a non-streamed request races the engine against the client's
disconnect. Either way the row leaves at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from lookahead.loop import FINISH_REASONS, QueueFull
from lookahead.request import ContextExceeded, check_context, room
from lookahead.request import Request as EngineRequest
from lookahead.structured import GrammarError

from .errors import CLIENT_CLOSED, APIError, bad_request, overloaded
from .formats import ChatFormat, CompletionFormat, usage
from .protocol import ChatCompletionRequest, CompletionRequest
from .submission import Submission
from .tool_formats import detect, template_input
from .tools import ToolMode, answered_calls

# the engine's finish reasons (but "error", which is an error response) as the API shows them: a request the server
# ended (it is shutting down) is "abort", vLLM's name for it; the openai client takes any string here
API_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
assert set(API_FINISH_REASONS) == set(FINISH_REASONS) - {"error"}


@dataclass(frozen=True)
class _Asked:
    """One generating request as the engine runs it: its body, its prompt's ids (and the field they came from), its
    response's format, its grammar (None: free text; and the field that asked for it), and with tools what makes the
    grammar of a plain answer, asked for when the answer only repeats calls answered already (`ToolMode.repeats`):
    the request is then answered again under it, in text."""

    body: ChatCompletionRequest | CompletionRequest
    prompt: list[int]
    prompt_param: str
    fmt: ChatFormat | CompletionFormat
    grammar: object = None
    grammar_param: str | None = None
    text_grammar: Callable[[], Awaitable[object]] | None = None


async def chat(served, request: Request, body: ChatCompletionRequest) -> Response:
    _refuse_what_cannot_fit(served, sum(len(message.content or "") for message in body.messages), "messages")
    tools = ToolMode.of(body.tools, body.tool_choice, body.parallel_tool_calls, answered_calls(body.messages),
                        detect(getattr(served.tokenizer, "chat_template", None)))
    prompt = await served.tokenize(_chat_prompt, body, tools)
    param = "tools" if tools else "response_format"
    grammar = await _grammar(served, tools.schema() if tools else body.json_schema, param)
    text_grammar = None
    if tools is not None and tools.answered and tools.choice == "auto":  # (for an answer that repeats a call)
        async def text_grammar():
            return await _grammar(served, tools.text_only().schema(), param)
    return await _generate(served, request, _Asked(body, prompt, "messages", ChatFormat(served, body, tools), grammar,
                                                   param, text_grammar))


async def complete(served, request: Request, body: CompletionRequest) -> Response:
    if isinstance(body.prompt, str):
        _refuse_what_cannot_fit(served, len(body.prompt), "prompt")
        prompt = await served.tokenize(_encode, body.prompt)
        if not prompt:
            raise bad_request("prompt: the prompt is empty (it encodes to no tokens)", "prompt")
    else:
        prompt = body.prompt
        _check_ids(prompt, served.vocab_size, "prompt")
    grammar = await _grammar(served, body.json_schema, "response_format")
    return await _generate(served, request, _Asked(body, prompt, "prompt", CompletionFormat(served, body), grammar,
                                                   "response_format"))


async def _grammar(served, schema, param: str):
    """The request's grammar (None: free text); 400 naming `param` for a schema the grammar engine cannot compile."""
    if schema is None:
        return None
    try:
        return await served.grammar(schema)
    except GrammarError as e:
        raise bad_request(f"{param}: the JSON schema cannot be compiled: {e}", param) from None


def _refuse_what_cannot_fit(served, characters: int, param: str) -> None:
    """400 before tokenizing a text that cannot fit the model's positions whatever its tokens: no token holds more
    than the vocabulary's longest token's characters, so the text needs at least characters / longest tokens."""
    positions = served.max_positions
    fewest = -(-characters // served.longest_token)
    if positions is not None and fewest > positions:
        raise bad_request(f"This model's maximum context length is {positions} tokens. However, your {param} hold "
                          f"{characters} characters, at least {fewest} tokens. Please reduce the length of the "
                          f"{param}.", param, code="context_length_exceeded")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _chat_prompt(tokenizer, body: ChatCompletionRequest, tools: ToolMode | None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages, own = template_input(tokenizer.chat_template, body.messages, tools)  # (own: the template's tools=)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                                            return_dict=False, **(body.chat_template_kwargs or {}), **own)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:  # the template refused the messages
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # some versions return an encoding anyway


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", param)


async def _generate(served, request: Request, asked: _Asked) -> Response:
    arrival = time.perf_counter()
    body, prompt, fmt, text_grammar = asked.body, asked.prompt, asked.fmt, asked.text_grammar
    max_new_tokens = _max_new_tokens(served, body, len(prompt), asked.prompt_param)
    stop_ids = () if body.ignore_eos else served.eos_token_ids
    if body.stop_token_ids:
        _check_ids(body.stop_token_ids, served.vocab_size, "stop_token_ids")
        stop_ids = (*stop_ids, *body.stop_token_ids)

    def submit(grammar) -> Submission:
        try:
            # the same Request that Engine.run and Llama.generate take: one prompt, with the engine's configuration
            generation = EngineRequest([prompt], max_new_tokens, body.sampling(served.sampling_defaults),
                                       served.engine.lookahead, frozenset(stop_ids), body.engine_seed())
            return Submission(served.engine, served.engine_tokenizer, served.metrics, generation, stop=body.stop,
                              logprobs=body.engine_logprobs, arrival=arrival, grammar=grammar)
        except QueueFull as e:
            if not served.serving:
                raise overloaded("the server is shutting down; send the request again once it is back") from None
            raise overloaded(f"the server is busy ({e}); try again later") from None
        except ValueError as e:  # the engine's own checks (the request is checked before: a backstop)
            raise bad_request(str(e)) from None

    async def again() -> Submission:
        return submit(await text_grammar())

    submission = submit(asked.grammar)
    if body.stream:
        return _Stream(_sse(submission, asked, again if text_grammar else None), submission)
    final = await _until_done(submission, request)
    if final is not None and text_grammar is not None and final[2].finish_reason == "stop" and fmt.repeats(final[0]):
        submission = await again()
        final = await _until_done(submission, request)
    if final is None:  # the client has gone: nobody reads this
        return Response(status_code=CLIENT_CLOSED)
    text, logprobs, last = final
    if last.finish_reason == "error":
        raise _failed(submission, last, asked.grammar_param)
    if last.finish_reason == "cancelled":  # the server is stopping (a client that left gets nothing): a cut answer
        # is an error, so that a client that ignores finish_reason does not take it for the whole answer
        raise overloaded(f"the server is shutting down: the answer was cut after {len(last.result.tokens)} tokens; "
                         "send the request again once it is back")
    return JSONResponse(fmt.response(text, logprobs, API_FINISH_REASONS[last.finish_reason],
                                     usage(last.result, len(prompt))))


def _max_new_tokens(served, body, prompt_tokens: int, prompt_param: str) -> int:
    """The engine's max_new_tokens: the body's, or what remains of the model's positions; 400 past them."""
    positions = served.max_positions
    max_new_tokens = body.max_new_tokens
    if positions is None:  # no known limit: a default the engine cannot overrun
        return max_new_tokens if max_new_tokens is not None else 256
    if max_new_tokens is None:  # what remains; at least one token, so that a prompt that fills the context is refused
        max_new_tokens = max(room(prompt_tokens, positions), 1)
    try:
        check_context(prompt_tokens, max_new_tokens, positions)
    except ContextExceeded:  # said in the OpenAI API's words, naming the field to change
        param = (prompt_param if body.max_new_tokens is None or room(prompt_tokens, positions) < 1
                 else body.max_new_tokens_param)
        raise bad_request(f"This model's maximum context length is {positions} tokens. However, you requested "
                          f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the {prompt_param}, "
                          f"{max_new_tokens} in the completion). Please reduce the length of the {prompt_param} or "
                          "completion.", param, code="context_length_exceeded") from None
    return max_new_tokens


async def _until_done(submission: Submission, request: Request):
    """The whole answer (text, logprobs, last event), or None if the client disconnected first (then cancelled)."""

    async def collect():
        pieces, logprobs = [], []
        async for event in submission.events():
            pieces.append(event.text)
            logprobs.extend(event.logprobs or ())
            if event.finish_reason is not None:
                return "".join(pieces), logprobs, event

    answer = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
            submission.cancel()
    # a task just cancelled is not done yet (its cancellation runs at its next turn): only a done one has a result
    return answer.result() if answer.done() and not answer.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Stream(StreamingResponse):
    """Server-sent events that cancel their submission when the response ends unfinished, whatever ended it (the
    client disconnected, a send failed, the server's shutdown timed out)."""

    def __init__(self, content, submission: Submission) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.submission = submission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.cancel()


def _failed(submission: Submission, last, grammar_param: str | None) -> APIError:
    """The error a failed request answers: a grammar that failed is the schema's fault (400 naming it), anything
    else the server's (500)."""
    if submission.grammar_failed:
        return bad_request(f"{grammar_param}: the JSON schema cannot be followed: {last.error}", grammar_param,
                           code="unsatisfiable_schema")
    return APIError(500, f"generation failed: {last.error}")


async def _sse(submission: Submission, asked: _Asked, again=None) -> AsyncIterator[str]:
    """again: where set, an answer that only repeats calls answered already is answered again, in text, by the
    submission it makes (calls are held to the end: none has gone out)."""
    fmt, include_usage, prompt_tokens = asked.fmt, asked.body.include_usage, len(asked.prompt)
    try:
        # the role chunk goes out with the first token, not before the prefill: clients time the first token from
        # the first chunk
        opening = fmt.start()
        while True:
            again_now = False
            async for event in submission.events():
                for chunk in opening:
                    yield _data(chunk, include_usage)
                opening = []
                if event.finish_reason == "error":
                    yield _data(_failed(submission, event, asked.grammar_param).body(), False)
                    break
                if event.text or event.logprobs:
                    chunk = fmt.chunk(event.text, event.logprobs or [], None)
                    if chunk is not None:  # (tool calls go out whole, with the finish)
                        yield _data(chunk, include_usage)
                if event.finish_reason == "stop" and again is not None and fmt.repeats():
                    try:
                        submission, again, again_now = await again(), None, True
                    except APIError as e:  # (the queue is full, the server stopping)
                        yield _data(e.body(), False)
                        break
                    fmt.restart()
                    break
                if event.finish_reason is not None:
                    yield _data(fmt.chunk("", [], API_FINISH_REASONS[event.finish_reason]), include_usage)
                    if include_usage:
                        yield _data(fmt.usage_chunk(usage(event.result, prompt_tokens)), False)
            if not again_now:
                break
        yield "data: [DONE]\n\n"
    finally:
        submission.cancel()  # ended early (the client went): the row leaves at the next step boundary


def _data(chunk: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in chunk:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
