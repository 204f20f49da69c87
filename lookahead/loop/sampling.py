"""Turning logits into the target distribution (temperature, top-k, top-p) and drawing from it, keyed by position.

Plain sampling and lookahead's verification both draw with `sample_positions`, so the distribution that lookahead
preserves is exactly the one plain sampling draws from, and with a seed the tokens are the same too.

A draw is an exponential race: token argmax_i p_i / E_i with E_i ~ Exp(1) independent is distributed as p. The
keys E of the token at absolute position `position` are a function of the seed and that position only
(`position_keys`: a counter-based hash, computed on the device), never of how many steps came before or how
large they were. So the token at each position is a fixed function of the seed, the position and the target
distribution there: plain sampling takes it; a lookahead step computes it at every verified row (the input token
and each tree node, each for the position after it) and verification walks down the tree accepting a node exactly
when its token is its parent's winner, as greedy verification does with the argmax. The output is, token for
token, what seeded plain sampling gives, whatever the step sizes, the drafts, the batch or the number of
processes; a single draft token is accepted with its target probability, as Algorithm 4 accepts it, and a node's
children with the sum of theirs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lookahead.request import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k, then top-p."""
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
        # the top token always stays (as transformers, vLLM and llama.cpp keep it): a top_p below float32's range
        # (1e-46) rounds to 0 in the comparison and would drop every token, leaving a draw of id 0
        drop[..., 0] = False
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
    """[..., V] weights (probabilities, need not be normalised) and [..., V] Exp(1) keys -> the index of the race's
    winner, argmax_i w_i / E_i, per row: a draw from the normalised weights."""
    return (weights.double() / keys).argmax(-1)


def fresh_seed() -> int:
    """A seed for a generation that was given none."""
    return random.SystemRandom().randrange(2**63)


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap alike)
_GOLDEN, _M1, _M2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 whose outputs look independent."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b] seeds and [b, R] absolute positions (int64, on one device) -> [b, R, V] float64 Exp(1) keys of the race
    for the token at each position; a function of (seed, position, token id) only."""
    rows = _mix(_mix(seeds[:, None] + _GOLDEN) + positions * _GOLDEN)  # [b, R]
    tokens = (torch.arange(1, vocab + 1, dtype=torch.int64, device=positions.device) * _GOLDEN)  # [V]
    bits = _shr(_mix(rows[..., None] + tokens), 11)  # [b, R, V]: 53 random bits each
    uniform = (bits.double() + 0.5) * 2.0**-53  # in (0, 1): the key is never 0 or inf
    return -torch.log(uniform)


def sample_positions(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """[b, R, V] logits of rows whose next tokens take absolute positions `positions` [b, R], seeds [b] -> [b, R]
    int64: the token each row's target distribution gives at its position under its row's seed. No device sync."""
    probs = target_probs(logits, params)
    return race(probs, position_keys(seeds, positions, logits.shape[-1]))


@dataclass(frozen=True)
class SampleRequest:
    """Sampling's part of a step: the target (`params`), the generation's seed, and for each output row of the step
    the absolute position its next token takes. The model returns each row's winner (`StepOutput.sampled`),
    computed on its device beside the argmax (`compute`), or with a fetch of its own (`fetch`)."""

    params: SamplingParams
    seed: int
    positions: tuple[int, ...]

    def compute(self, logits: torch.Tensor) -> torch.Tensor:
        """The [R, V] logits of the step's output rows -> [R] int64 winners on the logits' device (no sync)."""
        device = logits.device
        seeds = torch.tensor([seed_bits(self.seed)], dtype=torch.int64, device=device)
        positions = torch.tensor([self.positions], dtype=torch.int64, device=device)
        return sample_positions(logits[None], self.params, seeds, positions)[0]

    def fetch(self, logits: torch.Tensor) -> list[int]:
        """`compute`, fetched to the host: for a model that does not fold it into its step's one copy."""
        return self.compute(logits).tolist()


def seed_bits(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits (what a device buffer holds)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed
