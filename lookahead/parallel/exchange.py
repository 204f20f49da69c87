"""What the ranks of a lookahead-parallel step tell each other: one fixed-size message per rank, all-gathered.

Rank r's message, in an order every rank derives from the step's layout and split (so no index travels):
a status (OK or FAILED: a rank whose step raised says so before raising, so the others raise too instead of
waiting), the argmax of each output row it owns, when sampling each such row's seeded winner too, and the top-k
tokens of each step index it owns (when the tree's recycling asks for them). Everything travels as float64, which
holds token ids exactly; the messages are padded to the longest, which every rank can compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lookahead.loop import StepLayout

from .substep import StepSplit

OK, FAILED = 1.0, -1.0


@dataclass(frozen=True)
class MessagePlan:
    """Each rank's message contents: the step indices whose output row it reports (`rows[r]`: the argmax, and when
    `sampling` the winner), the step indices whose top-k it sends (`topk[r]`), and the padded message length."""

    rows: tuple[tuple[int, ...], ...]
    topk: tuple[tuple[int, ...], ...]
    k: int
    sampling: bool
    size: int

    @classmethod
    def of(cls, layout: StepLayout, split: StepSplit, sampling: bool) -> MessagePlan:
        row_of, ranks = layout.row_of, range(len(split.owned))
        rows = tuple(tuple(i for i in owned if i in row_of) for owned in split.owned)
        k = layout.topk
        topk = split.owned if k else tuple(() for _ in ranks)
        per_row = 2 if sampling else 1
        size = max(1 + per_row * len(r) + k * len(t) for r, t in zip(rows, topk, strict=True))
        return cls(rows, topk, k, sampling, size)

    def pack(self, rank: int, argmax: dict[int, int], sampled: dict[int, int],
             topk: dict[int, torch.Tensor]) -> torch.Tensor:
        """Rank `rank`'s message [size] float64 from its step's outputs, by step index."""
        values = [OK, *(argmax[i] for i in self.rows[rank])]
        if self.sampling:
            values += [sampled[i] for i in self.rows[rank]]
        for i in self.topk[rank]:
            values += topk[i].tolist()
        message = torch.zeros(self.size, dtype=torch.float64)
        message[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return message

    def failed(self) -> torch.Tensor:
        """The message of a rank whose step raised."""
        message = torch.zeros(self.size, dtype=torch.float64)
        message[0] = FAILED
        return message

    def unpack(self, gathered: torch.Tensor) -> tuple[dict[int, int], dict[int, int], dict[int, list[int]]]:
        """Every rank's messages [K, size] -> argmax, sampled winners (empty when greedy) and top-k, by step index.
        The caller has checked the statuses."""
        argmax: dict[int, int] = {}
        sampled: dict[int, int] = {}
        topk: dict[int, list[int]] = {}
        for rank, row in enumerate(gathered.tolist()):
            owned = self.rows[rank]
            at = 1 + len(owned)
            argmax.update(zip(owned, map(int, row[1:at]), strict=True))
            if self.sampling:
                sampled.update(zip(owned, map(int, row[at : at + len(owned)]), strict=True))
                at += len(owned)
            for i in self.topk[rank]:
                topk[i] = [int(t) for t in row[at : at + self.k]]
                at += self.k
        return argmax, sampled, topk


def failed_ranks(gathered: torch.Tensor) -> list[int]:
    """The ranks whose message says their step failed."""
    return [rank for rank, status in enumerate(gathered[:, 0].tolist()) if status != OK]
