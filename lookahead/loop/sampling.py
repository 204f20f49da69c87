"""Turning logits into the target distribution (temperature, top-k, top-p) and drawing from it.

Plain sampling and lookahead's sample verification both use `target_probs`, so the distribution that
lookahead preserves is exactly the one plain sampling draws from.

Draws are exponential races: token argmax_i p_i / E_i with E_i ~ Exp(1) independent is distributed as p,
and the same race over p with some tokens removed is a draw from the renormalised rest. So a step's model
can compute, on its device and before its one device-to-host copy, everything sampling verification reads
(`SampleRequest`): the target probability of each draft token at its parent, and at every verified row the
race's winner among the tokens that no draft offered there (Algorithm 4's residual after rejecting all of
them, which is the only residual it ever draws from, or the full target where no draft was offered). A
step draws once, at the row where the walk stops, which depends only on the uniforms and the
probabilities, not on the race's keys: so one key vector per step serves every row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lookahead.request import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] fp32 probabilities after temperature, top-k, then top-p."""
    # shift the max to 0 and divide in float64: any temperature > 0, however small (1e-40), stays finite
    # (the max at 0, the rest at most -inf), where fp32 logits / 1e-40 overflow to inf and softmax gives NaN
    logits = logits.double()
    logits = ((logits - logits.max(-1, keepdim=True).values) / params.temperature).float()
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = _descending_head(probs, params.top_p)
        # keep the smallest head whose mass reaches top_p: drop a token once the mass before it does
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


CPU_HEAD = 1024  # tokens a CPU sorts first for top-p; a whole vocabulary only when their mass falls short


def _descending_head(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities in descending order and their token ids, at least as far as the mass reaches top_p.

    On a CPU, sorting every row of a 50k-128k vocabulary costs as much as a small model's step, and top-p
    keeps a short head: the top CPU_HEAD tokens suffice when their mass reaches top_p in every row (every token
    after them is dropped anyway), checked on the host, which costs a CPU nothing. Elsewhere the full sort,
    which a GPU does fast and with no device sync."""
    if probs.device.type == "cpu" and probs.shape[-1] > CPU_HEAD:
        head, order = torch.topk(probs, CPU_HEAD, dim=-1)
        if bool((head.cumsum(-1)[..., -1] >= top_p).all()):
            return head, order
    return torch.sort(probs, dim=-1, descending=True)


def race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[..., V] weights (probabilities, need not be normalised) and [V] or [..., V] Exp(1) keys -> the index
    of the race's winner, argmax_i w_i / E_i, per row: a draw from the normalised weights."""
    return (weights.double() / keys).argmax(-1)


class Sampler:
    """The random source of one generation: uniforms in Python, the races' keys on the model's device."""

    def __init__(self, seed: int | None, device: torch.device) -> None:
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self.uniform = random.Random(seed).random
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

    def keys(self, vocab: int) -> torch.Tensor:
        """[V] float64 Exp(1) keys for one race, on the device (never 0, so a token of probability 0 never wins)."""
        keys = torch.empty(vocab, dtype=torch.float64, device=self.device)
        return keys.exponential_(generator=self._generator).clamp_(min=torch.finfo(torch.float64).tiny)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a [V] probability vector (need not be normalised)."""
        return int(race(probs, self.keys(probs.shape[-1])))


@dataclass(frozen=True)
class SampleRequest:
    """What sampling reads of one step, to compute on the model's device beside the argmax.

    The step's output rows read are row 0 (the input token) and rows `first_draft_row`.. (one per draft slot):
    verified slot 0 is row 0, slot 1 + j is row first_draft_row + j. `pairs` holds (slot, token) for every
    draft token: its token at the slot of its parent (the draft's edges; no two alike). A plain step is
    `first_draft_row` 1 with a single output row and no pairs.
    """

    params: SamplingParams
    sampler: Sampler
    first_draft_row: int
    pairs: tuple[tuple[int, int], ...] = ()

    def slots(self, num_rows: int) -> int:
        """Verified slots of a step with `num_rows` output rows."""
        return 1 + num_rows - self.first_draft_row

    def compute(self, logits: torch.Tensor) -> torch.Tensor:
        """The [R, V] logits of a step's output rows -> `sample_on_device`'s int64 [S + P] row, on the device (no
        sync), to fetch with the step's other outputs and read back by `unpack`."""
        pairs = pair_tensor([self], self.slots(logits.shape[0]) - 1, logits.device)
        return sample_on_device(logits[None], self.params, self.first_draft_row, pairs,
                                self.sampler.keys(logits.shape[-1])[None])[0]

    def fetch(self, logits: torch.Tensor) -> SampleReads:
        """`compute` and `unpack` with a fetch of its own, for a model that does not fold it into its step's copy."""
        return self.unpack(self.compute(logits).cpu(), self.slots(logits.shape[0]))

    def unpack(self, fetched: torch.Tensor, slots: int) -> SampleReads:
        """The host side of `sample_on_device`'s int64 row [slots + P]."""
        draws, probs = split_sampled(fetched, slots, len(self.pairs))
        return SampleReads(draws, dict(zip(self.pairs, probs, strict=True)))


@dataclass(frozen=True)
class SampleReads:
    """A step's sampling reads, on the host: per verified slot, the race's winner without the draft tokens
    offered there (`draws`); per (slot, draft token), its target probability (`probs`)."""

    draws: list[int]
    probs: dict[tuple[int, int], float]


def split_sampled(fetched: torch.Tensor, slots: int, pairs: int) -> tuple[list[int], list[float]]:
    """A host copy of `sample_rows`' int64 row -> the `slots` draws and the first `pairs` pairs' probabilities (the
    rest is padding)."""
    return fetched[:slots].tolist(), fetched[slots : slots + pairs].view(torch.float64).tolist()


def padded_pairs(request: SampleRequest, size: int) -> list[int]:
    """A request's (slot, token) pairs as [2 * size] ints, slots then tokens, padded to `size`, the step's draft
    slots (S - 1), with (S, 0): slot S is the zero row `sample_on_device` appends, so padding neither reads nor
    removes anything real."""
    pad = size - len(request.pairs)
    if pad < 0:
        raise ValueError(f"{len(request.pairs)} draft pairs do not fit the step's {size} draft slots")
    return [*(slot for slot, _ in request.pairs), *[size + 1] * pad, *(token for _, token in request.pairs), *[0] * pad]


def pair_tensor(requests: Sequence[SampleRequest], size: int, device: torch.device | str) -> torch.Tensor:
    """[b, 2, size] int64 on `device`: `padded_pairs` of each request."""
    rows = [padded_pairs(request, size) for request in requests]
    return torch.tensor(rows, dtype=torch.int64).view(len(requests), 2, size).to(device)


def sample_on_device(logits: torch.Tensor, params: SamplingParams, first_draft_row: int, pairs: torch.Tensor,
                     keys: torch.Tensor) -> torch.Tensor:
    """[b, R, V] logits of a step's output rows -> `sample_rows` of its verified rows (row 0, then rows
    first_draft_row..: S = 1 + R - first_draft_row slots). No device sync: it rides in the step's one copy."""
    return sample_rows(torch.cat([logits[:, :1], logits[:, first_draft_row:]], dim=1), params, pairs, keys)


def sample_rows(verified: torch.Tensor, params: SamplingParams, pairs: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
    """[b, S, V] logits of the verified slots, [b, 2, P] (slot, token) pairs (`padded_pairs`: padding names slot S),
    [b, V] race keys -> [b, S + P] int64: per slot the race's winner without that slot's pair tokens (the full
    target where removing them leaves nothing: only round-off can), then each pair's target probability as
    float64 bits."""
    probs = target_probs(verified, params)
    probs = torch.cat([probs, probs.new_zeros(probs.shape[0], 1, probs.shape[2])], dim=1)  # + padding's row
    batch = torch.arange(probs.shape[0], device=probs.device)[:, None]
    slot, token = pairs[:, 0], pairs[:, 1]
    picked = probs[batch, slot, token]  # [b, P]
    residual = probs.index_put((batch.expand_as(slot), slot, token), probs.new_zeros(()))[:, :-1]
    probs = probs[:, :-1]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    draws = race(residual, keys[:, None])
    return torch.cat([draws, picked.double().view(torch.int64)], dim=1)
