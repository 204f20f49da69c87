"""`SuffixIndex`: where the sequence's last tokens occurred before, and what followed them (prompt lookup).

An index of every m-gram (m = 1..max_match) of the prompt and the output so far, grown token by token,
so a step's query costs a few dictionary look-ups however long the sequence is (no rescan).
"""

from __future__ import annotations

from collections.abc import Sequence

_SCAN = 4  # occurrences looked at per continuation wanted, per match length


class SuffixIndex:
    """End positions of every m-gram of a growing sequence, m = 1..max_match."""

    def __init__(self, max_match: int = 4) -> None:
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_match = max_match
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing the m-grams that end at each of them."""
        seq, ends = self.tokens, self._ends
        for token in tokens:
            seq.append(token)
            i = len(seq)
            for m in range(1, min(self.max_match, i) + 1):
                key = tuple(seq[i - m :])
                found = ends.get(key)
                if found is None:
                    ends[key] = [i - 1]
                else:
                    found.append(i - 1)

    def continuations(self, limit: int, length: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` distinct continuations (at most `length` tokens) of earlier occurrences of the
        sequence's suffix, with the suffix length matched: longest match first, then most recent first."""
        seq = self.tokens
        n = len(seq)
        out: list[tuple[tuple[int, ...], int]] = []
        if limit <= 0 or length <= 0 or n < 2:
            return out
        taken: set[tuple[int, ...]] = set()
        used: set[int] = set()
        for m in range(min(self.max_match, n - 1), 0, -1):
            # a frequent token can have hundreds of occurrences whose continuations repeat: look at a few
            for end in reversed(self._ends.get(tuple(seq[n - m :]), ())[-_SCAN * limit :]):
                if end == n - 1 or end in used:  # the suffix itself; an occurrence already taken by a longer match
                    continue
                used.add(end)
                continuation = tuple(seq[end + 1 : end + 1 + length])
                if continuation not in taken:
                    taken.add(continuation)
                    out.append((continuation, m))
                    if len(out) == limit:
                        return out
        return out
