"""Structured outputs: JSON schemas (and a grammar of any JSON object) compiled by llguidance into the decode loop's
`TokenGrammar` (`lookahead.loop.grammar`), from a model's tokenizer.

`Grammars(tokenizer, vocab_size, stop_ids)` reads the tokenizer once (about 3 s for a 49k vocabulary); then
`json_schema(schema)` / `json_object()` compile a request's grammar in about a millisecond and return a fresh
`LLGuidanceGrammar` for one request. A schema the engine cannot compile raises `GrammarError` naming the problem, and
so does one that no text can follow: the compile probes the first mask past the tokens the schema forces (`{"$ref":
"#"}`, a property that is itself, are "unsatisfiable"). A grammar that fails later (llguidance's matcher in its error
state) allows only the stop tokens from then on, so its row ends at once, and says why in `error`.
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
PROBE_TOKENS = 256  # forced tokens the compile's probe follows at most before it asks for a mask


class GrammarError(ValueError):
    """A grammar the engine cannot compile (an unsupported or malformed schema), with the engine's reason."""


class LLGuidanceGrammar:
    """One request's `TokenGrammar` over an llguidance matcher. forced_drafts False: `forced` is always empty (the
    benchmark's baseline). `error`: why the matcher failed (None while it has not); once it has, the mask allows the
    stop tokens only (llguidance's own mask in its error state), so the row ends at its next token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, forced_drafts: bool = True) -> None:
        self.matcher, self.forced_drafts = matcher, forced_drafts
        self.seconds = 0.0
        self.error: str | None = None
        self.tokens = 0  # tokens accepted
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> torch.Tensor:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        self._check()
        self.seconds += time.perf_counter() - start
        return self._bitmask[0]

    def accept(self, token: int) -> None:
        start = time.perf_counter()
        if self.error is None:
            self.matcher.consume_token(token)
            self.tokens += 1
            self._check()
        self.seconds += time.perf_counter() - start

    def _check(self) -> None:
        if self.error is None and self.matcher.is_error():
            self.error = (f"the grammar failed after {self.tokens} tokens of the answer (llguidance: "
                          f"{_first_line(self.matcher.get_error(), lines=1)}); does the schema refer to itself "
                          "without end?")

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

    def lark(self, grammar: str, forced_drafts: bool = True) -> LLGuidanceGrammar:
        """A grammar in llguidance's Lark syntax (a chat template's tool-call format: `lookahead.serve.tool_formats`);
        raises `GrammarError` when it cannot be compiled."""
        try:
            text = llguidance.LLMatcher.grammar_from_lark(grammar)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return self._matcher(text, forced_drafts)

    def json_object(self, forced_drafts: bool = True) -> LLGuidanceGrammar:
        """Any JSON object (OpenAI's `response_format` "json_object")."""
        return self.json_schema({"type": "object"}, forced_drafts)

    def _matcher(self, grammar: str, forced_drafts: bool) -> LLGuidanceGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        self._probe(matcher)
        return LLGuidanceGrammar(matcher, self.vocab_size, forced_drafts)

    def _probe(self, matcher: llguidance.LLMatcher) -> None:
        """GrammarError "unsatisfiable" for a grammar that fails before the model has any choice: its first mask, past
        the tokens it forces (`{"a": ` of a property that is itself), on a copy. Also builds the first mask's lexer
        state here, on the compiling thread, not on the engine's."""
        probe = matcher.deep_copy()
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        for _ in range(PROBE_TOKENS):
            forced = probe.compute_ff_tokens()
            if not forced or probe.is_error() or not probe.consume_tokens(forced) or probe.is_error():
                break
        if not probe.is_error():
            llguidance.torch.fill_next_token_bitmask(probe, bitmask, 0)
        if probe.is_error():
            raise GrammarError(f"unsatisfiable schema: no JSON value follows it (llguidance: "
                               f"{_first_line(probe.get_error(), lines=1)}); does it refer to itself without end?")


def _first_line(error: str, lines: int | None = None) -> str:
    text = " ".join([line.strip() for line in error.strip().splitlines() if line.strip()][:lines])
    return text if len(text) <= 300 else text[:297] + "..."


def schema_text(schema: Any) -> str:
    """A schema as the model is shown it (compact JSON)."""
    return json.dumps(schema, separators=(", ", ": "), ensure_ascii=False)
