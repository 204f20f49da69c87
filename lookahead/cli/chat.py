"""The work of `lookahead chat`: a conversation with the model, one message a line, each answer streamed.

Each turn puts the whole conversation through the checkpoint's chat template; the model keeps the conversation's
KV cache between turns, so a turn prefills only what its prompt adds (the last answer's end and the new message).
`/reset` starts over; Ctrl-D (end of input) or Ctrl-C ends. On a terminal it prompts with `> `; from a pipe each
line of standard input is one message.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

from .generate import StreamPrinter, encode, generate_kwargs, load, plain_rate, summary
from .launch import world_size

RESET = "/reset"


def run(args: argparse.Namespace, stdin: TextIO | None = None) -> int:
    """Chat until the input ends; errors of the setup are raised for the front to print."""
    stdin = stdin or sys.stdin
    if world_size(os.environ) > 1:
        raise ValueError("lookahead chat runs in one process; use lookahead generate under torchrun")
    model, tokenizer, lookahead = load(args, None, _say)
    encode(tokenizer, [{"role": "user", "content": "?"}])  # no chat template: refused now, not after the first line
    interactive = stdin.isatty()
    if interactive:
        _say(f"type a message; {RESET} starts over, Ctrl-D ends")
    messages: list[dict] = []
    for text in _lines(stdin, interactive):
        if text == RESET:
            messages = []
            _say("a new conversation")
            continue
        messages.append({"role": "user", "content": text})
        prompt = encode(tokenizer, messages)
        printer = StreamPrinter(tokenizer, args.show_steps, color=sys.stdout.isatty())
        start = time.perf_counter()
        try:
            result = model.generate(prompt, **generate_kwargs(args, lookahead), stream=printer)
        except ValueError as e:  # the conversation outgrew the model's positions: say so, keep chatting
            messages.pop()
            _say(f"error: {' '.join(str(e).split())} ({RESET} starts over)")
            continue
        seconds = time.perf_counter() - start
        messages.append({"role": "assistant", "content": tokenizer.decode(result.tokens, skip_special_tokens=True)})
        print(flush=True)
        rate = None if lookahead is None else plain_rate(model, result, len(prompt))
        print(f"{summary(result, seconds, lookahead, plain_rate=rate)}; prompt {len(prompt)} tokens, "
              f"{result.cached_tokens} of them from the cache", file=sys.stderr, flush=True)
    return 0


def _lines(stdin: TextIO, interactive: bool):
    """The messages typed (blank lines skipped) until the input ends or Ctrl-C."""
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
