"""`SuffixIndex`: where the sequence's last tokens occurred before, and what followed them (prompt lookup).

An index of every m-gram (m = 1..max_match) of the prompt and the output so far, grown token by token,
so a step's query costs a few dictionary look-ups however long the sequence is (no rescan). A match of the
longest indexed m-gram is then measured further back token by token, up to `reach`: how long an exact match is
says how far its continuation can be trusted (text being copied), and indexing 16-grams would cost 4x the keys.
The drafting memory (`memory.py`) holds one over earlier generations' texts: texts joined by `SEPARATOR`, which no
m-gram and no continuation crosses, and forgotten from the front (`forget`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import lookahead.host_loops as host_loops

_SCAN = 4  # occurrences looked at per continuation wanted, per match length
SEPARATOR = -1  # not a token id: starts a text of its own


class SuffixIndex:
    """End positions of every m-gram of a growing sequence, m = 1..max_match (positions count forgotten tokens:
    `tokens[0]` is at position `start`)."""

    compiled = True  # extend and look up with the compiled loops where they build (`host_loops`); False: Python's

    def __init__(self, max_match: int = 4, reach: int = 0) -> None:
        """max_match: the longest m-gram indexed; reach: the longest match measured (at least max_match)."""
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_match = max_match
        self.reach = max(reach, max_match)
        self.tokens: list[int] = []
        self.start = 0
        self._run = 0  # tokens since the last separator: the longest m-gram ending at the next token is one more
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing the m-grams that end at each of them (none across a `SEPARATOR`). By the compiled
        loop where it builds, else `extend_python`: the same list and keys, in the same order."""
        module = host_loops.load() if self.compiled else None
        if module is None:
            self.extend_python(tokens)
        else:
            self._run = module.extend(self.tokens, self._ends, self.start, self._run, self.max_match, tokens)

    def extend_python(self, tokens: Sequence[int]) -> None:
        seq, ends, run = self.tokens, self._ends, self._run
        for token in tokens:
            seq.append(token)
            if token == SEPARATOR:
                run = 0
                continue
            run += 1
            i = len(seq)
            end = self.start + i - 1
            for m in range(1, min(self.max_match, run) + 1):
                key = tuple(seq[i - m :])
                found = ends.get(key)
                if found is None:
                    ends[key] = [end]
                else:
                    found.append(end)
        self._run = run

    def continuations(self, limit: int, length: int,
                      tail: Sequence[int] | None = None) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` distinct continuations (at most `length` tokens) of earlier occurrences of the
        sequence's suffix (or of `tail`'s, looked up in this index), with the suffix length matched (up to
        `reach`): longest match first, then most recent first. By the compiled loop where it builds (the drafts
        ask twice a step per row), else `continuations_python`: the same list."""
        module = host_loops.load() if self.compiled else None
        if module is None:
            return self.continuations_python(limit, length, tail)
        return module.continuations(self.tokens, self._ends, self.start, self.max_match, self.reach, limit, length,
                                    tail, _SCAN)

    def continuations_python(self, limit: int, length: int,
                             tail: Sequence[int] | None = None) -> list[tuple[tuple[int, ...], int]]:
        seq = self.tokens
        n = len(seq)
        out: list[tuple[tuple[int, ...], int]] = []
        if tail is None:  # the sequence's own suffix: not a match of itself
            tail, longest, itself = seq, min(self.max_match, n - 1), self.start + n - 1
        else:
            longest, itself = min(self.max_match, len(tail)), None
        if limit <= 0 or length <= 0 or longest < 1:
            return out
        taken: set[tuple[int, ...]] = set()
        used: set[int] = set()
        for m in range(longest, 0, -1):
            found = []
            # the longest indexed m is measured further back and sorted by that before any is taken; a shorter one's
            # occurrences are taken as they come, so its scan stops at the limit
            measured = m == self.max_match
            # a frequent token can have hundreds of occurrences whose continuations repeat: look at a few
            for end in reversed(self._ends.get(tuple(tail[len(tail) - m :]), ())[-_SCAN * limit :]):
                if end == itself or end in used:  # the suffix itself; an occurrence already taken by a longer match
                    continue
                used.add(end)
                i = end + 1 - self.start
                continuation = tuple(seq[i : i + length])
                if SEPARATOR in continuation:  # the next text is not what followed
                    continuation = continuation[: continuation.index(SEPARATOR)]
                if not continuation:
                    continue
                if measured:
                    found.append((continuation, self._matched(tail, end, m)))
                elif continuation not in taken:
                    taken.add(continuation)
                    out.append((continuation, m))
                    if len(out) == limit:
                        return out
            found.sort(key=lambda item: -item[1])  # longest first (the sort is stable)
            for continuation, matched in found:
                if continuation not in taken:
                    taken.add(continuation)
                    out.append((continuation, matched))
                    if len(out) == limit:
                        return out
        return out

    def _matched(self, tail: Sequence[int], end: int, m: int) -> int:
        """How many tokens the occurrence ending at `end` and `tail` have in common backwards, known to be >= m, up
        to `reach` (a `SEPARATOR`, never in `tail`, and the forgotten tokens stop it)."""
        if m < self.max_match:
            return m
        seq, limit = self.tokens, min(self.reach, len(tail), end + 1 - self.start)
        i = end - self.start
        while m < limit and seq[i - m] == tail[-1 - m]:
            m += 1
        return m

    def forget(self, upto: int) -> None:
        """Drop the tokens before position `upto`, which must begin a text (a `SEPARATOR`, or the end), with every
        m-gram that ends among them."""
        cut = upto - self.start
        assert 0 <= cut <= len(self.tokens) and (cut == len(self.tokens) or self.tokens[cut] == SEPARATOR)
        seq, keys, run = self.tokens, set(), 0
        for i in range(cut):
            if seq[i] == SEPARATOR:
                run = 0
                continue
            run += 1
            keys.update(tuple(seq[i + 1 - m : i + 1]) for m in range(1, min(self.max_match, run) + 1))
        for key in keys:
            found = self._ends[key]
            del found[: bisect_left(found, upto)]
            if not found:
                del self._ends[key]
        del seq[:cut]
        self.start = upto
        if not seq:
            self._run = 0

    @property
    def keys(self) -> int:
        """Distinct m-grams indexed."""
        return len(self._ends)
