"""What the ranks of a lookahead-parallel step tell each other: one fixed-size message per rank, all-gathered.

Rank r's message, in an order every rank derives from the step's layout and split (so no index travels):
a status (OK or FAILED: a rank whose step raised says so before raising, so the others raise too instead of
waiting), the argmax of each output row it owns, the top-k tokens of each step index it owns (when the tree's
recycling asks for them), and, when sampling, the probabilities `targets.reads` lists at the rows it owns.
Everything travels as float64, which holds token ids and float32 probabilities exactly; the messages are
padded to the longest, which every rank can compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import StepLayout
from .substep import StepSplit
from .targets import reads

OK, FAILED = 1.0, -1.0


@dataclass(frozen=True)
class MessagePlan:
    """Each rank's message contents: the step indices whose argmax (`argmax[r]`) and top-k (`topk[r]`) it sends,
    and the (step index, token) probabilities (`probs[r]`) it sends; `size` is the padded message length."""

    argmax: tuple[tuple[int, ...], ...]
    topk: tuple[tuple[int, ...], ...]
    probs: tuple[tuple[tuple[int, int], ...], ...]
    k: int
    size: int

    @classmethod
    def of(cls, layout: StepLayout, split: StepSplit, sampling: bool) -> MessagePlan:
        row_of = layout.row_of
        argmax = tuple(tuple(i for i in owned if i in row_of) for owned in split.owned)
        k = layout.topk
        topk = split.owned if k else tuple(() for _ in split.owned)
        pairs = reads(layout) if sampling else []
        probs = tuple(tuple(p for p in pairs if split.owner[p[0]] == rank) for rank in range(len(split.owned)))
        size = max(1 + len(a) + k * len(t) + len(p) for a, t, p in zip(argmax, topk, probs, strict=True))
        return cls(argmax, topk, probs, k, size)

    def pack(self, rank: int, argmax: dict[int, int], topk: dict[int, torch.Tensor],
             probs: dict[tuple[int, int], float]) -> torch.Tensor:
        """Rank `rank`'s message [size] float64 from its step's outputs (by step index)."""
        values = [OK, *(argmax[i] for i in self.argmax[rank])]
        for i in self.topk[rank]:
            values += topk[i].tolist()
        values += [probs[p] for p in self.probs[rank]]
        message = torch.zeros(self.size, dtype=torch.float64)
        message[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return message

    def failed(self) -> torch.Tensor:
        """The message of a rank whose step raised."""
        message = torch.zeros(self.size, dtype=torch.float64)
        message[0] = FAILED
        return message

    def unpack(self, gathered: torch.Tensor) -> tuple[dict[int, int], dict[int, list[int]],
                                                      dict[tuple[int, int], float]]:
        """Every rank's messages [K, size] -> argmax by step index, top-k by step index, probabilities by (step index,
        token). The caller has checked the statuses."""
        rows = gathered.tolist()
        argmax: dict[int, int] = {}
        topk: dict[int, list[int]] = {}
        probs: dict[tuple[int, int], float] = {}
        for rank, row in enumerate(rows):
            at = 1
            for i in self.argmax[rank]:
                argmax[i] = int(row[at])
                at += 1
            for i in self.topk[rank]:
                topk[i] = [int(t) for t in row[at : at + self.k]]
                at += self.k
            for pair in self.probs[rank]:
                probs[pair] = row[at]
                at += 1
        return argmax, topk, probs


def failed_ranks(gathered: torch.Tensor) -> list[int]:
    """The ranks whose message says their step failed."""
    return [rank for rank, status in enumerate(gathered[:, 0].tolist()) if status != OK]
