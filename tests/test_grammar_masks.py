"""The loop's reading of a grammar's bitmask (`lookahead.loop.grammar`): a token past the mask's end is never allowed,
so a mask shorter than the model's vocabulary (a tokenizer smaller than the embedding table, as SmolLM2's and Qwen's
are) can never let the model pick a padding id."""

from __future__ import annotations

import torch

from lookahead.loop.grammar import allowed, masked_choice
from lookahead.request import SamplingParams


class OneWordGrammar:
    """A grammar over 32 token ids that allows `ids` only, whatever came before."""

    seconds = 0.0

    def __init__(self, ids: list[int]) -> None:
        self.bitmask = torch.zeros(1, dtype=torch.int32)
        for i in ids:
            self.bitmask |= torch.tensor([1 << i], dtype=torch.int64).to(torch.int32)
        self.taken: list[int] = []

    def mask(self) -> torch.Tensor:
        return self.bitmask

    def accept(self, token: int) -> None:
        self.taken.append(token)


def test_ids_past_a_short_mask_are_not_allowed():
    mask = torch.tensor([-1], dtype=torch.int32)  # all 32 ids of its one word allowed
    keep = allowed(mask, 40)
    assert keep.shape == (40,) and keep[:32].all() and not keep[32:].any()
    assert allowed(torch.tensor([0b101], dtype=torch.int32), 8).tolist() == [True, False, True] + [False] * 5


def test_the_models_favourite_past_the_mask_is_never_chosen():
    """The model's argmax (and almost all its mass) sits on id 39, past the mask's one word: greedy and sampled
    choices both take an id the grammar allows."""
    logits = torch.zeros(40)
    logits[39] = 50.0
    logits[5] = 1.0
    for seed in (None, 0, 1, 2):
        grammar = OneWordGrammar([5, 7])
        token = masked_choice(grammar, logits, SamplingParams(temperature=1.0) if seed is not None else
                              SamplingParams(), seed, position=3)
        assert token in (5, 7) and grammar.taken == [token]
