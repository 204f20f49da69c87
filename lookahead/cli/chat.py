"""The work of `lookahead chat`: a conversation with the model, one message a line, each answer streamed.

Each turn puts the whole conversation through the checkpoint's chat template; the model keeps the conversation's
KV cache between turns, so a turn prefills only what its prompt adds (the last answer's end and the new message).
`/reset` starts over; Ctrl-D (end of input) or Ctrl-C at the prompt ends. Ctrl-C during an answer stops the answer
at its next tokens and keeps the conversation, the answer so far included (a second one stops it at once; the
model's cache then trusts none of its cached prefixes, since a step cut midway may have left them half written).
On a terminal it prompts with `> `; from a pipe each line of standard input is one message, and an empty input ends
before the model loads. A line that is not UTF-8 is refused, the conversation kept.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from .generate import StreamPrinter, encode, generate_kwargs, load, summary
from .launch import world_size
from .report import Timed
from .text import check_text

RESET = "/reset"


class _Stopped(Exception):
    """Ctrl-C during an answer: raised from the stream, between steps."""


def run(args: argparse.Namespace, stdin: TextIO | None = None) -> int:
    """Chat until the input ends; errors of the setup are raised for the front to print."""
    stdin = stdin or sys.stdin
    if world_size(os.environ) > 1:
        raise ValueError("lookahead chat runs in one process; use lookahead generate under torchrun")
    if hasattr(stdin, "reconfigure"):  # undecodable bytes reach us as lone surrogates (refused per line), not as
        stdin.reconfigure(errors="surrogateescape")  # a UnicodeDecodeError that ends the conversation
    interactive = stdin.isatty()
    lines = _lines(stdin, interactive)
    if not interactive:  # from a pipe or a file: nothing to answer is known before the model loads
        first = next(lines, None)
        if first is None:
            _say("no message on standard input: nothing to answer")
            return 0
        lines = itertools.chain([first], lines)
    model, tokenizer, lookahead = load(args, None, _say)
    encode(tokenizer, [{"role": "user", "content": "?"}])  # no chat template: refused now, not after the first line
    if interactive:
        _say(f"type a message; {RESET} starts over, Ctrl-D ends, Ctrl-C stops an answer")
    messages: list[dict] = []
    for text in lines:
        if text == RESET:
            messages = []
            _say("a new conversation")
            continue
        try:
            check_text(text, "that line")
        except ValueError as e:
            _say(f"error: {e}; the conversation goes on")
            continue
        messages.append({"role": "user", "content": text})
        prompt = encode(tokenizer, messages)
        printer = StreamPrinter(tokenizer, args.show_steps, color=sys.stdout.isatty())
        start = time.perf_counter()
        try:
            with _ctrl_c_stops_the_answer() as stopped:
                result = model.generate(prompt, **generate_kwargs(args, lookahead), stream=_stoppable(printer, stopped))
        except ValueError as e:  # the conversation outgrew the model's positions: say so, keep chatting
            messages.pop()
            _say(f"error: {' '.join(str(e).split())} ({RESET} starts over)")
            continue
        except (_Stopped, KeyboardInterrupt):  # (a step cut midway by a second Ctrl-C: the runner trusts no cached
            print(flush=True)  # prefix after it, so the next turn prefills whole; see CachedRunner)
            messages.append({"role": "assistant", "content": tokenizer.decode(printer.tokens,
                                                                              skip_special_tokens=True)})
            _say("stopped; the answer so far stays in the conversation")
            continue
        run = Timed(result, time.perf_counter() - start)
        messages.append({"role": "assistant", "content": tokenizer.decode(result.tokens, skip_special_tokens=True)})
        print(flush=True)
        # no plain-decoding figure beside it: timing one would cost every turn a probe, and the cost model's (the
        # forward pass alone) read 42 tok/s beside a turn that gave 7 (its rate includes the prompt's prefill)
        print(f"{summary(run, lookahead)}; prompt {len(prompt)} tokens, {result.cached_tokens} of them "
              "from the cache (the rate includes prefilling the rest)", file=sys.stderr, flush=True)
    return 0


def _stoppable(printer: StreamPrinter, stopped: Callable[[], bool]) -> Callable[[list[int]], None]:
    def stream(tokens: list[int]) -> None:
        if stopped():
            raise _Stopped
        printer(tokens)

    return stream


@contextlib.contextmanager
def _ctrl_c_stops_the_answer() -> Iterator[Callable[[], bool]]:
    """While an answer runs, a first Ctrl-C (SIGINT) is noted, and the stream stops the answer at its next tokens (a
    step boundary, where the model's cache is whole); a second raises KeyboardInterrupt at once. Yields whether one
    was pressed. Where SIGINT is ignored (a background job) or off the main thread, nothing changes."""
    pressed: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield lambda: False
        return

    def note(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


def _lines(stdin: TextIO, interactive: bool) -> Iterator[str]:
    """The messages typed (blank lines skipped) until the input ends or Ctrl-C at the prompt."""
    while True:
        try:
            line = input("> ") if interactive else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not interactive and not line:  # end of input
            return
        if line.strip():
            yield line.strip()


def _say(message: str) -> None:
    print(f"lookahead: {message}", file=sys.stderr, flush=True)
