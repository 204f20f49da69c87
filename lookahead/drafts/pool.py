"""The n-gram pool: n-grams keyed by their first token, at most G per key, the most recent kept, each with the
tokens that preceded it (its context), so a query can prefer n-grams that followed what precedes the key now."""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT = 2  # tokens kept before each n-gram


class NGramPool:
    """n-grams of size `ngram`, stored as key token -> continuations (ngram - 1 tokens each).

    Per key, continuations are kept in recency order without duplicates; adding one that is already
    there makes it the most recent; past `capacity` the oldest is dropped. Every operation costs
    O(ngram), independent of how much has been generated.
    """

    def __init__(self, ngram: int, capacity: int) -> None:
        if ngram < 2 or capacity < 0:
            raise ValueError(f"NGramPool needs ngram >= 2 and capacity >= 0, got {ngram}, {capacity}")
        self.ngram = ngram
        self.capacity = capacity
        # key -> {continuation: context}; dicts keep insertion order: oldest first
        self._grams: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}

    def add(self, gram: Sequence[int], context: tuple[int, ...] = ()) -> None:
        """Add one n-gram (exactly `ngram` tokens); `context`: the tokens before it, the nearest last."""
        if len(gram) != self.ngram:
            raise ValueError(f"expected a {self.ngram}-gram, got {len(gram)} tokens")
        if self.capacity == 0:
            return
        continuations = self._grams.setdefault(gram[0], {})
        continuation = tuple(gram[1:])
        continuations.pop(continuation, None)
        continuations[continuation] = context
        if len(continuations) > self.capacity:
            del continuations[next(iter(continuations))]

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` that begins at index `start` or later."""
        for i in range(max(start, 0), len(tokens) - self.ngram + 1):
            self.add(tokens[i : i + self.ngram], tuple(tokens[max(i - CONTEXT, 0) : i]))

    def candidates(self, token: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of `token`, most recent first."""
        continuations = self._grams.get(token)
        if not continuations or limit <= 0:
            return []
        out = []
        for continuation in reversed(continuations):
            out.append(continuation)
            if len(out) == limit:
                break
        return out

    def ranked(self, token: int, limit: int, context: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` (continuation, match) of `token`: match = how many of the tokens before `token` now
        (`context`, the nearest last) equal those stored with the n-gram (0..CONTEXT); higher match first,
        then the most recent."""
        continuations = self._grams.get(token)
        if not continuations or limit <= 0:
            return []
        now = tuple(context[-CONTEXT:])
        scored = []
        for age, (continuation, before) in enumerate(reversed(continuations.items())):
            match = 0
            while match < len(now) and match < len(before) and before[-1 - match] == now[-1 - match]:
                match += 1
            scored.append((-match, age, continuation))
        scored.sort()
        return [(continuation, -m) for m, _, continuation in scored[:limit]]

    def __len__(self) -> int:
        return sum(len(c) for c in self._grams.values())
