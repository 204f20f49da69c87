"""What the ranks of a lookahead-parallel step tell each other: one fixed-size message per rank, all-gathered.

Rank r's message, in an order every rank derives from the step's layout and split (so no index travels):
a status (OK or FAILED: a rank whose step raised says so before raising, so the others raise too instead of
waiting), the argmax of each output row it owns, the top-k tokens of each step index it owns (when the tree's
recycling asks for them), and, when sampling, what verification reads at the verified slots it owns
(`sampling.SampleReads`): each slot's race winner and the probability of each draft token offered there
(`StepLayout.draft_pairs`, whose slot is its parent's). Everything travels as float64, which holds token ids
and float64 probabilities exactly; the messages are padded to the longest, which every rank can compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lookahead.loop import StepLayout
from lookahead.loop.sampling import SampleReads

from .substep import StepSplit

OK, FAILED = 1.0, -1.0


@dataclass(frozen=True)
class MessagePlan:
    """Each rank's message contents: the step indices whose argmax (`argmax[r]`) and top-k (`topk[r]`) it sends,
    the verified step indices whose race winner it sends (`draws[r]`), and the (slot, token) probabilities
    (`probs[r]`) it sends; `slots` is the step's verified slot count and `size` the padded message length."""

    argmax: tuple[tuple[int, ...], ...]
    topk: tuple[tuple[int, ...], ...]
    draws: tuple[tuple[int, ...], ...]
    probs: tuple[tuple[tuple[int, int], ...], ...]
    k: int
    slots: int
    size: int

    @classmethod
    def of(cls, layout: StepLayout, split: StepSplit, sampling: bool) -> MessagePlan:
        row_of, ranks = layout.row_of, range(len(split.owned))
        argmax = tuple(tuple(i for i in owned if i in row_of) for owned in split.owned)
        k = layout.topk
        topk = split.owned if k else tuple(() for _ in ranks)
        verified = [0, *layout.node_indices] if sampling else []
        draws = tuple(tuple(i for i in verified if split.owner[i] == rank) for rank in ranks)
        pairs = layout.draft_pairs if sampling else ()
        probs = tuple(tuple(p for p in pairs if split.owner[layout.index_of_slot(p[0])] == rank) for rank in ranks)
        size = max(1 + len(a) + k * len(t) + len(d) + len(p) for a, t, d, p in zip(argmax, topk, draws, probs,
                                                                                     strict=True))
        slots = layout.num_slots
        return cls(argmax, topk, draws, probs, k, slots, size)

    def pack(self, rank: int, argmax: dict[int, int], topk: dict[int, torch.Tensor], draws: dict[int, int],
             probs: dict[tuple[int, int], float]) -> torch.Tensor:
        """Rank `rank`'s message [size] float64 from its step's outputs (by step index; probabilities by pair)."""
        values = [OK, *(argmax[i] for i in self.argmax[rank])]
        for i in self.topk[rank]:
            values += topk[i].tolist()
        values += [draws[i] for i in self.draws[rank]]
        values += [probs[p] for p in self.probs[rank]]
        message = torch.zeros(self.size, dtype=torch.float64)
        message[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return message

    def failed(self) -> torch.Tensor:
        """The message of a rank whose step raised."""
        message = torch.zeros(self.size, dtype=torch.float64)
        message[0] = FAILED
        return message

    def unpack(self, layout: StepLayout, gathered: torch.Tensor) -> tuple[dict[int, int], dict[int, list[int]],
                                                                          SampleReads | None]:
        """Every rank's messages [K, size] -> argmax by step index, top-k by step index, and when sampling the
        whole step's `SampleReads`. The caller has checked the statuses."""
        argmax: dict[int, int] = {}
        topk: dict[int, list[int]] = {}
        draws: dict[int, int] = {}
        probs: dict[tuple[int, int], float] = {}
        for rank, row in enumerate(gathered.tolist()):
            at = 1
            for i in self.argmax[rank]:
                argmax[i] = int(row[at])
                at += 1
            for i in self.topk[rank]:
                topk[i] = [int(t) for t in row[at : at + self.k]]
                at += self.k
            for i in self.draws[rank]:
                draws[layout.slot_of_index(i)] = int(row[at])
                at += 1
            for pair in self.probs[rank]:
                probs[pair] = row[at]
                at += 1
        sampled = None
        if any(self.draws):  # padding slots (none in an exact-size step) are never read: -1
            sampled = SampleReads([draws.get(slot, -1) for slot in range(self.slots)], probs)
        return argmax, topk, sampled


def failed_ranks(gathered: torch.Tensor) -> list[int]:
    """The ranks whose message says their step failed."""
    return [rank for rank, status in enumerate(gathered[:, 0].tolist()) if status != OK]
