"""The n-gram pool: n-grams keyed by their first token, at most G per key, the most recent kept."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice


class NGramPool:
    """n-grams of size `ngram`, stored as key token -> continuations (ngram - 1 tokens each).

    Per key, continuations are kept in recency order without duplicates; adding one that is already
    there makes it the most recent; past `capacity` the oldest is dropped. Every operation costs
    O(ngram), independent of how much has been generated.

    (An n-gram's preceding tokens were once stored too, to prefer n-grams whose context matches the current one;
    they moved S by less than 1% on the dev prompts (bench/results/pool-context-cpu.json) and not at all on
    synthetic texts, so they are gone.)
    """

    def __init__(self, ngram: int, capacity: int) -> None:
        if ngram < 2 or capacity < 0:
            raise ValueError(f"NGramPool needs ngram >= 2 and capacity >= 0, got {ngram}, {capacity}")
        self.ngram = ngram
        self.capacity = capacity
        # key -> continuations, as dict keys: dicts keep insertion order, oldest first
        self._grams: dict[int, dict[tuple[int, ...], None]] = {}

    def add(self, gram: Sequence[int]) -> None:
        """Add one n-gram (exactly `ngram` tokens)."""
        if len(gram) != self.ngram:
            raise ValueError(f"expected a {self.ngram}-gram, got {len(gram)} tokens")
        if self.capacity == 0:
            return
        continuations = self._grams.setdefault(gram[0], {})
        continuation = tuple(gram[1:])
        continuations.pop(continuation, None)
        continuations[continuation] = None
        if len(continuations) > self.capacity:
            del continuations[next(iter(continuations))]

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` that begins at index `start` or later (`add` of each, inline: this runs for
        every row every step)."""
        n, capacity, grams = self.ngram, self.capacity, self._grams
        if capacity == 0:
            return
        for i in range(max(start, 0), len(tokens) - n + 1):
            continuations = grams.setdefault(tokens[i], {})
            continuation = tuple(tokens[i + 1 : i + n])
            continuations.pop(continuation, None)
            continuations[continuation] = None
            if len(continuations) > capacity:
                del continuations[next(iter(continuations))]

    def candidates(self, token: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of `token`, most recent first."""
        continuations = self._grams.get(token)
        if not continuations or limit <= 0:
            return []
        return list(islice(reversed(continuations), limit))

    def items(self):
        """(key token, its continuations oldest first) pairs: what the drafting memory keeps of a generation's pool."""
        return ((key, tuple(continuations)) for key, continuations in self._grams.items())

    def __len__(self) -> int:
        return sum(len(c) for c in self._grams.values())
