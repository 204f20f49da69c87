"""`RecycleTables`: the model's own next-token predictions, recorded at every row of every step, per context.

Token recycling: a step computes the model's top-k next tokens at all its rows (the lookahead levels, the
tree's nodes, the input token), right or wrong drafts alike; each row's list is kept under the row's token,
under the pair (the token before it in the row's context, its token) and under the triple (the two tokens
before it, its token), so a later step can draft from what the model predicted after the same tokens last
time. The longest context seen is the sharpest (the pair table's first choice is the argmax more often than the
token table's, and drafting from the triple table where it has an entry raised S: docs/results.md, the budget
split with triple-context recycling, bench/results/tri18-cpu.json); the shorter ones are the fallback for contexts
never seen.

All live on the host, not on the model's device: the next step's tree is built on the host before that step
is launched, so reading a device table would add a device-to-host sync per step, whereas the top-k of all
rows already arrive in the step's one device-to-host copy (with the argmax), so a host table costs no transfer
of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import lookahead.host_loops as host_loops

_BITS = 21  # a context key packs token ids + 1 (ids from -1, "none", to 2**21 - 2) into one int


class RecycleTables:
    """(two previous tokens, token), (previous token, token) and token -> top-k, as dicts of lists: a step writes a
    few hundred rows with three `dict.update` calls, and the tree builder reads a list per node with no
    conversion. A context's key is one int, which hashes faster than a tuple."""

    def __init__(self) -> None:
        self.triples: dict[int, list[int]] = {}
        self.pairs: dict[int, list[int]] = {}
        self.single: dict[int, list[int]] = {}

    def update(self, second: Sequence[int], previous: Sequence[int], tokens: Sequence[int],
               topk: Sequence[Sequence[int]] | np.ndarray) -> None:
        """Rows of one step: the token two before each row's token in its context [R] (-1: none), the one before
        [R], the row's token [R] and its top-k next tokens [R, k]; a later row wins over an earlier one with the
        same key."""
        rows = topk.tolist() if isinstance(topk, np.ndarray) else topk
        pairs = [(p + 1) << _BITS | (t + 1) for p, t in zip(previous, tokens, strict=True)]
        self.triples.update(zip([(s + 1) << 2 * _BITS | k for s, k in zip(second, pairs, strict=True)], rows,
                                strict=True))
        self.pairs.update(zip(pairs, rows, strict=True))
        self.single.update(zip(tokens, rows, strict=True))

    def update_step(self, rows: Sequence[int], parents: Sequence[int], tokens: Sequence[int], before: tuple[int, int],
                    topk: torch.Tensor, compiled: bool = True) -> None:
        """Rows of one step, each keyed by its own context in the step: `rows`, step indices (a later one wins);
        `parents`, each step token's predecessor in its context (-1: the input token's, the sequence's token before
        it); `tokens`, the step's tokens; `before`, the sequence's two tokens before the input token (-1: none);
        `topk` [T, k] int64 on the host, every step token's top-k. By the compiled loop (`host_loops.learn`) where it
        builds (compiled=False: the Python one, for tests); the same entries in the same order either way."""
        module = host_loops.load() if compiled and topk.dtype == torch.int64 and topk.device.type == "cpu" else None
        if module is None:
            self.update_step_python(rows, parents, tokens, before, topk)
        else:
            module.learn(self.triples, self.pairs, self.single, rows, parents, tokens, before[0], before[1],
                         topk.numpy())

    def update_step_python(self, rows: Sequence[int], parents: Sequence[int], tokens: Sequence[int],
                           before: tuple[int, int], topk: torch.Tensor) -> None:
        # each row's two tokens before it in its context: step indices, or -1 / -2 for the sequence's last two before
        # the input token, which Python's negative indices find at the end of these extended lists
        parent = [*parents, -2]  # the input token's predecessor (-1) is preceded by -2
        extended = [*tokens, *before]
        first = [parent[i] for i in rows]
        second = [parent[p] for p in first]
        lists = topk.tolist()  # (one conversion, then list indexing: faster than numpy's fancy indexing here)
        self.update([extended[p] for p in second], [extended[p] for p in first], [extended[i] for i in rows],
                    [lists[i] for i in rows])

    def lookup(self, second: int, previous: int, token: int) -> tuple[list[int] | None, Sequence[int]]:
        """(the list of the longest context seen, triple or pair, or None if neither; the token's list, empty if
        unknown, when there is no context list)."""
        pair = (previous + 1) << _BITS | (token + 1)
        found = self.triples.get((second + 1) << 2 * _BITS | pair)
        if found is None:
            found = self.pairs.get(pair)
        if found is not None:
            return found, ()
        return None, self.single.get(token, ())
