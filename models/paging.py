"""The bookkeeping of a paged KV cache: `BlockPool`, which blocks are free, which rows hold which (reference counts),
and which full blocks hold a known prefix that a later sequence may take instead of prefilling it; and beside it
`RowTables`, the rows themselves: each row's block table over the pool, its length, its tokens and its keyed blocks.

A block is in exactly one of three states:
- **free**: nothing in it is kept;
- **held**: by one or more rows (its reference count); a row writes only into blocks it alone holds, and blocks it
  shares with other rows are full blocks of a common prefix, which nobody writes;
- **cached**: held by no row, but full and keyed by its content, kept for a prefix match until memory is needed, then
  evicted least recently used first.

A full block's key is (its parent's key id, its tokens): the tokens of every position before it and in it, so two
blocks with one key hold the KV entries of the same tokens at the same positions, which is what makes one a stand-in
for the other (docs/DESIGN.md, "Paged KV"). Key ids are never reused, so a key whose parent chain was evicted can no
longer be matched, and ages out. Nothing here touches tensors: the runner owns the memory, this owns the accounting.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

Key = tuple[int, tuple[int, ...]]  # (parent key id, -1 for a first block; the block's tokens)


class BlockPool:
    """`num_blocks` blocks of `block_size` positions each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._free = collections.deque(range(num_blocks))  # lowest first: a fresh pool hands out contiguous runs
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none, oldest use first
        self._key_of: dict[int, Key] = {}  # block -> its key
        self._id_of: dict[int, int] = {}  # block -> its key's id
        self._block_of: dict[Key, int] = {}  # key -> block
        self._next_id = 0

    def grow(self, num_blocks: int) -> None:
        """Add free blocks up to `num_blocks` in all (the memory behind them is the caller's)."""
        self._free.extend(range(self.num_blocks, num_blocks))
        self.refs += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = max(self.num_blocks, num_blocks)

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: the free ones and the cached ones (evicted to make room)."""
        return len(self._free) + len(self._cached)

    @property
    def free(self) -> int:
        """Blocks nothing is kept in."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Blocks held by no row but kept for prefix matches."""
        return len(self._cached)

    @property
    def held(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one row, each held once: free ones first, then the least recently used cached ones
        (forgetting their keys). ValueError if fewer than `count` are available (check `available` first)."""
        if count > self.available:
            raise ValueError(f"{count} blocks asked for, {self.available} available")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def match(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
        """The longest run of full blocks keyed by `tokens`' first positions, within the first `limit` positions:
        (the blocks, each now held once more, and their key ids)."""
        size, parent, blocks, ids = self.block_size, -1, [], []
        for start in range(0, limit - size + 1, size):
            block = self._block_of.get((parent, tuple(tokens[start : start + size])))
            if block is None:
                break
            if self.refs[block] == 0:
                del self._cached[block]
            self.refs[block] += 1
            parent = self._id_of[block]
            blocks.append(block)
            ids.append(parent)
        return blocks, ids

    def publish(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Key a full block, held by the row that wrote it, by (parent key id, its tokens), so later sequences can
        match it; returns its key id. If another block holds that key already (two rows wrote the same prefix), that
        one stays the match and this block stays unkeyed (freed when released); its id is returned all the same."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are keyed: {len(tokens)} tokens for blocks of {self.block_size}")
        key = (parent, tuple(tokens))
        other = self._block_of.get(key)
        if other is not None:
            return self._id_of[other]
        self._key_of[block], self._id_of[block] = key, self._next_id
        self._block_of[key] = block
        self._next_id += 1
        return self._id_of[block]

    def release(self, blocks: Sequence[int]) -> None:
        """A row lets go of its blocks: each held by no one any more becomes cached if keyed, else free.

        Last block first, so a prefix's later blocks are older in the eviction order than its first: evicting a first
        block makes every block after it unmatchable, so it goes last (as nano-vllm and vLLM free them)."""
        for block in reversed(blocks):
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def clear_cache(self) -> None:
        """Forget every key (the weights changed: no cached entry is what a prefill would compute now); cached blocks
        become free, held ones stay held, unkeyed."""
        for block in list(self._key_of):
            self._forget(block)
        self._free.extend(self._cached)
        self._cached.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key], self._id_of[block]

    def check(self) -> None:
        """Invariants (for tests): every block free, held or cached, exactly once; keys consistent."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        for block in range(self.num_blocks):
            states = (block in free) + (block in cached) + (self.refs[block] > 0)
            refs = self.refs[block]
            assert states == 1, f"block {block}: free {block in free}, cached {block in cached}, refs {refs}"
        assert all(block in self._key_of for block in cached)
        assert {self._block_of[k] for k in self._block_of} == set(self._key_of)


@dataclass
class Row:
    """A sequence in the cache: its blocks (its table), L, the token ids at positions 0..L-1 (None once unknown: then
    none of its blocks is keyed) and the key ids of its keyed blocks (its first `len(keys)` blocks)."""

    blocks: list[int]
    length: int = 0
    tokens: list[int] | None = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    step_tokens: Sequence[int] = ()  # the last step's tokens, for its commit


class RowTables:
    """The rows of a paged cache over `blocks`: admitted with the longest run of cached blocks that begins their
    prompt and new blocks for the rest, their full blocks keyed as their committed positions fill them, released to
    the pool (their keyed blocks stay cached). Like the pool, it touches no tensor."""

    def __init__(self, blocks: BlockPool) -> None:
        self.blocks = blocks
        self.rows: dict[int, Row] = {}
        self._next_row = 0

    def admit(self, prompt: Sequence[int], need: int, prefix_cache: bool) -> tuple[int, int] | None:
        """A row of `need` blocks for `prompt`: the cached blocks that begin it (never its last token's, which must
        run for its logits; none without `prefix_cache`), then new ones; None while the pool lacks them. Returns
        (row, positions taken from the cache)."""
        size = self.blocks.block_size
        shared, keys = self.blocks.match(prompt, len(prompt) - 1) if prefix_cache else ([], [])
        if need - len(shared) > self.blocks.available:
            self.blocks.release(shared)
            return None
        row = Row(shared + self.blocks.allocate(need - len(shared)))
        row.length = cached = len(shared) * size
        row.tokens = list(prompt[:cached])
        row.keys = keys
        index, self._next_row = self._next_row, self._next_row + 1
        self.rows[index] = row
        return index, cached

    def release(self, row: int) -> None:
        """The row leaves: its blocks go back to the pool (its keyed ones stay cached for later prefix matches)."""
        self.blocks.release(self.rows.pop(row).blocks)

    def publish(self, row: Row) -> None:
        """Key the row's blocks that its committed positions have filled (its tokens known)."""
        size = self.blocks.block_size
        while (len(row.keys) + 1) * size <= row.length:
            b = len(row.keys)
            parent = row.keys[-1] if row.keys else -1
            row.keys.append(self.blocks.publish(row.blocks[b], parent, row.tokens[b * size : (b + 1) * size]))

    def slot(self, row: Row, position: int) -> int:
        """The pool slot of the row's `position`, through its table."""
        size = self.blocks.block_size
        return row.blocks[position // size] * size + position % size

    def clear_cache(self) -> None:
        """Forget every cached prefix (the weights changed, or a step was cut midway): no row's blocks are keyed
        from now on."""
        self.blocks.clear_cache()
        for row in self.rows.values():
            row.tokens = None
