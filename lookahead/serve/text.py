"""A request's text as its tokens arrive: incremental detokenization, stop strings, and what may be streamed yet.

`TextStream` is fed one token at a time, in order (by the engine's `stops_at` on its thread, so a stop string ends
the output at the token that completes it, even inside a multi-token step). Its text is what a user gets from
`tokenizer.decode(tokens, skip_special_tokens=True)` over the same tokens, cut before the first stop string, as
vLLM and OpenAI return it. Text goes out in pieces whose concatenation is exactly that text:

- a window of the last tokens is decoded with the tokens before it as context (vLLM's incremental detokenization),
  so a piece is never decoded without what precedes it (SentencePiece's leading spaces, byte-level merges);
- a window whose text ends in U+FFFD (an incomplete UTF-8 character) waits for the bytes that complete it;
- text that may be the start of a stop string is held back until the next tokens say whether it is: each stop
  string's matcher (`_StopMatcher`, Knuth-Morris-Pratt) knows how much of it the text ends with, kept up to date
  character by character, so a token costs the same however long the text and the stop strings are;
- the last piece is taken from one decode of all the tokens, so the whole is the full decode's even where windows
  could differ from it.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence

log = logging.getLogger("lookahead.serve")

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces


class TextStream:
    """One request's output text, fed token by token. stop: the stop strings (the text ends before the first)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self._matchers = [_StopMatcher(s) for s in self.stop]
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of `tokens` (up to the stop, once one is found)
        self.stopped = False
        self._start = self._read = 0  # the window: tokens[_start:_read] gave the last piece, its context now
        self._released = 0  # characters of `text` handed out by `take`

    def feed(self, token: int) -> bool:
        """One more token; True when the text now holds a stop string (first found: the output ends here)."""
        self.tokens.append(token)
        if self.stopped:  # a stop token after a stop string cannot come: the engine ends the output at the first
            return True
        before = len(self.text)
        piece, pending = self._piece()
        self.text += piece
        return self._find_stop(before, pending)

    def take(self, final: bool = False) -> str:
        """The text not yet handed out that is safe to hand out now; `final`: all of it, from a decode of every
        token (the request has ended)."""
        if final:
            self._finish()
            end = len(self.text)
        else:
            end = len(self.text) if self.stopped else len(self.text) - self._held()
        piece, self._released = self.text[self._released : end], max(self._released, end)
        return piece

    def _piece(self) -> tuple[str, str]:
        """The new text of the last token decoded in its window, and the window's text that waits for the rest of a
        character (what the window gives while it ends mid-character: whole characters, then U+FFFD)."""
        prefix = self._decode(self.tokens[self._start : self._read])
        text = self._decode(self.tokens[self._start :])
        if len(text) <= len(prefix):
            return "", ""
        if text.endswith(REPLACEMENT):
            return "", text[len(prefix) :]
        self._start, self._read = self._read, len(self.tokens)
        return text[len(prefix) :], ""

    def _find_stop(self, before: int, pending: str) -> bool:
        """Look for a stop string that ends in the text added after `before` (the waiting characters included: a
        stop string completed by the whole characters before an incomplete one stops at this token, as it does in a
        decode of the tokens so far); cut the text before the first one."""
        added, found = self.text[before:], None
        for matcher in self._matchers:
            end = matcher.feed(added)  # the text so far: kept
            if end is None:
                end = matcher.peek(pending)  # the waiting characters: not kept (they may decode otherwise later)
                end = None if end is None else len(added) + end
            if end is not None:
                at = before + end + 1 - len(matcher.stop)
                found = at if found is None else min(found, at)
        if found is None:
            return False
        self.text, self.stopped = (self.text + pending)[:found], True
        return True

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string (held back until the next tokens)."""
        return max((matcher.matched for matcher in self._matchers), default=0)

    def _finish(self) -> None:
        """The text from one decode of all the tokens (cut at the first stop string), which the pieces so far begin."""
        full = self._decode(self.tokens)
        cut = [at for at in (full.find(stop) for stop in self.stop) if at >= 0]
        full = full[: min(cut)] if cut else full
        if full.startswith(self.text[: self._released]):
            self.text = full
        else:  # a tokenizer whose windows decode unlike the whole: keep what was streamed, say so
            log.warning("incremental detokenization diverged from the full decode; the streamed text is kept")

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""


class _StopMatcher:
    """How much of one stop string the text ends with (`matched`), as the text grows: Knuth-Morris-Pratt's automaton,
    each character O(1) amortized."""

    def __init__(self, stop: str) -> None:
        self.stop, self.matched = stop, 0
        self._fail = [0] * len(stop)  # [i]: the longest proper prefix of stop[: i + 1] that is also its suffix
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k

    def feed(self, text: str) -> int | None:
        """Take `text` as the text's continuation; the index in it where the first whole match ends (None)."""
        self.matched, end = self._run(self.matched, text)
        return end

    def peek(self, text: str) -> int | None:
        """As `feed`, but `text` is not kept."""
        return self._run(self.matched, text)[1]

    def _run(self, matched: int, text: str) -> tuple[int, int | None]:
        stop = self.stop
        for i, char in enumerate(text):
            while matched and stop[matched] != char:
                matched = self._fail[matched - 1]
            if stop[matched] == char:
                matched += 1
            if matched == len(stop):
                return matched, i
        return matched, None


class TokenText:
    """Each token's own text and bytes, as the OpenAI API reports them in logprobs (cached per token id).

    A token that is part of a UTF-8 character decodes to U+FFFD on its own; its bytes are then recovered from the
    vocabulary piece (byte-level BPE's byte alphabet, SentencePiece's <0xNN> byte fallback) where possible."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            data = text.encode("utf-8")
            if REPLACEMENT in text:
                data = self._raw_bytes(token) or data
            self._cache[token] = (text, list(data))
        return self._cache[token]

    def _raw_bytes(self, token: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return None
        match = _BYTE.fullmatch(piece)
        if match:
            return bytes([int(match[1], 16)])
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable character that stands for each byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
