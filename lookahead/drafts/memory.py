"""`DraftMemory`: what drafting learned, kept across generations (warm drafting): the recycled top-k tables, a
suffix index over earlier prompts and outputs, and pool n-grams.

Each generation that ends adds one segment: its text (prompt + output), its recycling tables and its pool. The
segments are merged into one table per source as they arrive, so a draft's look-up costs what it costs in a
generation's own tables (a dict get), whatever the number of segments; each segment remembers what it wrote, so
forgetting it, oldest first once the texts held pass `cap_tokens`, deletes exactly the entries that are still its
own (a later segment's entry under the same key stays). A generation reads the memory and writes it only at its end
(`LookaheadLoop.remember`), so the rows of a batch, which all end before any is added, never see each other's.

The memory holds evidence, never output: the draft builder scores its proposals as a separate source, below the
generation's own (`edges.py`), and verification decides what is accepted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from .edges import MATCH_BANDS
from .pool import NGramPool
from .recycle import RecycleTables
from .suffix import SEPARATOR, SuffixIndex

DEFAULT_CAP_TOKENS = 32768  # about 50 MB held when full at the default configuration (bytes_held's estimate)
POOL_PER_KEY = 8  # continuations kept per first token, the most recent
# bytes_held's estimate per item: a text token (its slot and its m-grams' keys and end positions), a recycled row
# (its top-8 list of ints and its entries in the generation's and the merged tables), a pool continuation (a tuple
# of N - 1 ints and its entries), measured once with tracemalloc on segments of the default configuration's shape
# (18 rows a step, ids up to 49152): within 1% of the traced total. A text costs about 1.5 KB a token with its rows.
_BYTES = {"token": 650, "row": 700, "gram": 250}


@dataclass
class _Segment:
    start: int  # the suffix index's position of its SEPARATOR
    tokens: int
    recycle: RecycleTables
    pool: list[tuple[int, tuple[tuple[int, ...], ...]]]


class DraftMemory:
    """Drafting state kept across generations, at most `cap_tokens` tokens of text (oldest segments forgotten first).

    Read by a generation through `recycled`, `continuations` and `candidates`; written by `add` at its end; emptied
    by `clear`. Not thread-safe: `Llama.generate` holds the model's lock around every use.
    """

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS, match: int = 4) -> None:
        if isinstance(cap_tokens, bool) or not isinstance(cap_tokens, int) or cap_tokens < 0:
            raise ValueError(f"cap_tokens must be an int >= 0, got {cap_tokens!r}")
        self.cap_tokens = cap_tokens
        self._match = match
        self.clear()

    def clear(self) -> None:
        """Forget everything."""
        self.recycle = RecycleTables()
        self.suffix = SuffixIndex(self._match, reach=MATCH_BANDS[-1])
        self._grams: dict[int, dict[tuple[int, ...], _Segment]] = {}  # key -> continuation -> its segment
        self._segments: deque[_Segment] = deque()
        self.tokens_held = 0

    @property
    def generations(self) -> int:
        """Segments held: the generations remembered."""
        return len(self._segments)

    @property
    def bytes_held(self) -> int:
        """An estimate of the host memory held (per-item costs measured once, `_BYTES`; not `sys.getsizeof`)."""
        rows = len(self.recycle.triples)
        grams = sum(len(c) for c in self._grams.values())
        return _BYTES["token"] * self.tokens_held + _BYTES["row"] * rows + _BYTES["gram"] * grams

    def add(self, text: Sequence[int], recycle: RecycleTables, pool: NGramPool | None) -> None:
        """Remember one generation: its prompt + output `text` (the last `cap_tokens` of it), its recycling tables
        (taken, not copied: the generation is over) and its pool's n-grams; then forget the oldest past the cap."""
        if self.cap_tokens == 0:
            return
        text = list(text[-self.cap_tokens :])
        segment = _Segment(self.suffix.start + len(self.suffix.tokens), len(text), recycle,
                           list(pool.items()) if pool is not None else [])
        self.suffix.extend([SEPARATOR, *text])
        for mine, merged in zip(_tables(recycle), _tables(self.recycle), strict=True):
            merged.update(mine)
        for key, continuations in segment.pool:
            kept = self._grams.setdefault(key, {})
            for continuation in continuations:
                kept.pop(continuation, None)
                kept[continuation] = segment
            while len(kept) > POOL_PER_KEY:
                del kept[next(iter(kept))]
        self._segments.append(segment)
        self.tokens_held += segment.tokens
        while self.tokens_held > self.cap_tokens:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        segment = self._segments.popleft()
        self.tokens_held -= segment.tokens
        after = self._segments[0].start if self._segments else self.suffix.start + len(self.suffix.tokens)
        self.suffix.forget(after)
        for mine, merged in zip(_tables(segment.recycle), _tables(self.recycle), strict=True):
            for key, row in mine.items():
                if merged.get(key) is row:  # still this segment's (rows are distinct list objects)
                    del merged[key]
        for key, continuations in segment.pool:
            kept = self._grams.get(key)
            for continuation in continuations:
                if kept is not None and kept.get(continuation) is segment:
                    del kept[continuation]
            if kept is not None and not kept:
                del self._grams[key]

    # the read side, for the draft builder

    def recycled(self, second: int, previous: int, token: int) -> tuple[list[int] | None, Sequence[int]]:
        """`RecycleTables.lookup` over every generation held."""
        return self.recycle.lookup(second, previous, token)

    def continuations(self, tail: Sequence[int], limit: int, length: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` continuations of `tail`'s suffix in the texts held (`SuffixIndex.continuations`)."""
        return self.suffix.continuations(limit, length, tail)

    def candidates(self, token: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` pool continuations of `token`, most recent first."""
        kept = self._grams.get(token)
        if not kept or limit <= 0:
            return []
        return list(islice(reversed(kept), limit))  # (not the whole dict reversed into a list)


def _tables(recycle: RecycleTables) -> tuple[dict, dict, dict]:
    return recycle.triples, recycle.pairs, recycle.single
