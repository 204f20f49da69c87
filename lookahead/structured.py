"""Structured outputs: JSON schemas (and a grammar of any JSON object) compiled by llguidance into the decode loop's
`TokenGrammar` (`lookahead.loop.grammar`), from a model's tokenizer.

`Grammars(tokenizer, vocab_size, stop_ids)` reads the tokenizer once (about 3 s for a 49k vocabulary); then
`json_schema(schema)` / `json_object()` compile a request's grammar in about a millisecond and return a fresh
`LLGuidanceGrammar` for one request. A schema the engine cannot compile raises `GrammarError` naming the problem.
JSON comes out compact, as `json.dumps` writes it (", " and ": ", no other whitespace), so most of a schema's
punctuation and keys are forced tokens. Work is bounded: each mask's and the compile's lexer work by llguidance's
fuel (`LIMITS`: about 15 ms and 20 ms at its measured speed), and the loop counts every grammar second in the step's
cost (`TokenGrammar.seconds`).

Why llguidance (docs/DESIGN.md, "Structured outputs"): of the three engines measured on this CPU with SmolLM2's
tokenizer (`bench/grammar_masks.py`), it compiles a schema fastest, its masks are fast enough by two orders of
magnitude, it handles any tokenization of the text (not only the canonical one), and it gives forced tokens
(`compute_ff_tokens`) and non-destructive checks (`validate_tokens`) directly; it needs no torch of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

# compact JSON, as json.dumps writes it: whitespace the schema leaves free would be the model's to choose (and a small
# model's to loop on), and fixed separators make them forced tokens
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LIMITS = llguidance.LLParserLimits(step_lexer_fuel=200_000, initial_lexer_fuel=1_000_000)
MAX_FORCED = 32  # forced tokens drafted per step at most


class GrammarError(ValueError):
    """A grammar the engine cannot compile (an unsupported or malformed schema), with the engine's reason."""


class LLGuidanceGrammar:
    """One request's `TokenGrammar` over an llguidance matcher. forced_drafts False: `forced` is always empty (the
    benchmark's baseline)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, forced_drafts: bool = True) -> None:
        self.matcher, self.forced_drafts = matcher, forced_drafts
        self.seconds = 0.0
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> torch.Tensor:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        self.seconds += time.perf_counter() - start
        return self._bitmask[0]

    def accept(self, token: int) -> None:
        start = time.perf_counter()
        self.matcher.consume_token(token)
        self.seconds += time.perf_counter() - start

    def valid(self, tokens: Sequence[int]) -> int:
        start = time.perf_counter()
        count = self.matcher.validate_tokens(list(tokens))
        self.seconds += time.perf_counter() - start
        return count

    def forced(self) -> list[int]:
        if not self.forced_drafts:
            return []
        start = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()[:MAX_FORCED]
        self.seconds += time.perf_counter() - start
        return tokens

    @property
    def done(self) -> bool:
        """The grammar is complete: only a stop token may follow."""
        return self.matcher.is_stopped()


class Grammars:
    """Compiles request grammars for one tokenizer. stop_ids: the tokens that end an answer (the model's EOS): the
    grammar allows them exactly where the text it describes is complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]) -> None:
        stops = sorted(set(stop_ids))
        if not stops:
            raise ValueError("structured outputs need a stop token (the model's EOS) to end a complete answer")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)

    def json_schema(self, schema: Any, forced_drafts: bool = True) -> LLGuidanceGrammar:
        """A grammar of the JSON documents valid under `schema` (a dict, or True for any JSON value); raises
        `GrammarError` when it cannot be compiled."""
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return self._matcher(grammar, forced_drafts)

    def json_object(self, forced_drafts: bool = True) -> LLGuidanceGrammar:
        """Any JSON object (OpenAI's `response_format` "json_object")."""
        return self.json_schema({"type": "object"}, forced_drafts)

    def _matcher(self, grammar: str, forced_drafts: bool) -> LLGuidanceGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return LLGuidanceGrammar(matcher, self.vocab_size, forced_drafts)


def _first_line(error: str) -> str:
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return text if len(text) <= 300 else text[:297] + "..."


def schema_text(schema: Any) -> str:
    """A schema as the model is shown it (compact JSON)."""
    return json.dumps(schema, separators=(", ", ": "), ensure_ascii=False)
