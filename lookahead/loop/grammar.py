"""Constrained decoding inside the loop: a row's grammar masks the model's choice at every verified position, cuts
the drafts it rejects before the step runs, and offers the tokens it forces as a draft chain of its own.

The loop knows a grammar only through `TokenGrammar` (token ids in, token ids out: no tokenizer here); the server
builds one from the model's tokenizer (`lookahead.serve.structured`). Exact by construction:

- **Masked choices along the walk.** Verification walks down the tree from the input token (`verify`); at each slot
  it takes the model's choice there. With a grammar that choice is made under the grammar's mask at the state the
  accepted tokens before it reached: `GrammarChoices` computes it when the walk asks for it (so only along the
  accepted path, in order), then advances the grammar over it. Every token the walk asks for is accepted (a
  matching child, or the step's last token), so the grammar advances over accepted tokens only and never rolls
  back. The choice is the masked argmax, or the seeded race over the masked target distribution at that position
  (`SampleRequest`): what plain constrained decoding chooses there, token for token.
- **Drafts cut before the forward.** `constrain_draft` drops every draft node the grammar rejects at its parent's
  state (and so its subtree): such a node could never be accepted, and a step need not pay for it.
- **Forced tokens as free drafts.** Where the grammar allows one continuation, its tokens (`TokenGrammar.forced`)
  go first into the step's tree as a chain scored 1, the rest of the draft merged under it; verified like any draft.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from lookahead.drafts import ROOT, BestFirst
from lookahead.request import SamplingParams

from .sampling import SampleRequest

FORCED_SCORE = 1.0  # a forced token's chance of acceptance: the model cannot choose otherwise
_BITS = torch.arange(32, dtype=torch.int32)


class TokenGrammar(Protocol):
    """One request's grammar state, advanced over the tokens the row accepts.

    mask: the tokens allowed next as a bitmask, [ceil(V / 32)] int32, bit t % 32 of word t // 32 (llguidance's and
        xgrammar's layout; a token past its end is not allowed).
    accept: the row took `token` next (always one the mask allowed).
    valid: of `tokens` in order from the current state, how many the grammar accepts (the state is unchanged).
    forced: tokens the grammar forces next, in order (empty: none, or forced drafts are off).
    seconds: time spent in the grammar so far (masks, checks, forced tokens): part of the row's step cost.
    """

    seconds: float

    def mask(self) -> torch.Tensor: ...

    def accept(self, token: int) -> None: ...

    def valid(self, tokens: Sequence[int]) -> int: ...

    def forced(self) -> list[int]: ...


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[ceil(V / 32)] int32 bitmask -> [vocab] bool: which token ids it allows (ids past the mask are not)."""
    bits = ((bitmask[:, None] >> _BITS) & 1).flatten().bool()
    if bits.numel() >= vocab:
        return bits[:vocab]
    return torch.cat([bits, bits.new_zeros(vocab - bits.numel())])


def masked_choice(grammar: TokenGrammar, logits: torch.Tensor, sampling: SamplingParams, seed: int | None,
                  position: int) -> int:
    """The token chosen from one position's [V] logits under the grammar's current mask: the masked argmax (greedy,
    seed None), else the seeded race over the masked target distribution at absolute `position`. Then the grammar
    advances over it."""
    start = time.perf_counter()
    keep = allowed(grammar.mask(), logits.shape[-1]).to(logits.device)
    masked = logits.float().masked_fill(~keep, float("-inf"))
    if seed is None:
        token = int(masked.argmax())
    else:
        token = SampleRequest(sampling, seed, (position,)).fetch(masked[None])[0]
    grammar.seconds += time.perf_counter() - start  # (accept times itself)
    grammar.accept(token)
    return token


class GrammarChoices:
    """The `chosen` sequence `verify` walks: slot s's token, the masked choice from its output row, computed when the
    walk asks for it (in order down the accepted path; each token asked for is accepted, so the grammar advances).
    rows: each slot's output row; positions: each slot's next token's absolute position."""

    def __init__(self, grammar: TokenGrammar, logits: torch.Tensor, rows: Sequence[int], positions: Sequence[int],
                 sampling: SamplingParams, seed: int | None) -> None:
        self.grammar, self.logits, self.rows, self.positions = grammar, logits, rows, positions
        self.sampling, self.seed = sampling, seed

    def __getitem__(self, slot: int) -> int:
        return masked_choice(self.grammar, self.logits[self.rows[slot]], self.sampling, self.seed,
                             self.positions[slot])


def constrain_draft(draft: BestFirst, grammar: TokenGrammar, budget: int) -> BestFirst:
    """The draft without the nodes the grammar rejects (a node whose token its parent's state refuses, and its
    subtree), the grammar's forced tokens first as a chain scored `FORCED_SCORE`, at most `budget` nodes, best
    first (a parent before its children, scores non-increasing; an unscored draft, the paper's chains, stays
    unscored)."""
    start = time.perf_counter()
    scored = len(draft.scores) == len(draft)
    forced = grammar.forced()[:budget]
    tokens, parents, scores = list(forced), [ROOT, *range(len(forced) - 1)][: len(forced)], [FORCED_SCORE] * len(forced)
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens, strict=True))}
    keep = _grammar_keeps(draft, grammar)
    where: dict[int, int] = {}  # a kept draft node -> its node in the result
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        if not keep[node] or (parent != ROOT and parent not in where):
            continue
        up = ROOT if parent == ROOT else where[parent]
        present = children.get((up, token))
        if present is not None:  # on the forced chain already
            where[node] = present
        elif len(tokens) < budget:
            where[node] = children[(up, token)] = len(tokens)
            tokens.append(token)
            parents.append(up)
            if scored:
                scores.append(draft.scores[node])
    grammar.seconds += time.perf_counter() - start
    return BestFirst(tokens, parents, scores if scored else [])


def _grammar_keeps(draft: BestFirst, grammar: TokenGrammar) -> list[bool]:
    """For each draft node, whether the grammar accepts the path from the input token down to it: each leaf's path
    checked once (`valid` counts the accepted prefix)."""
    inner = set(draft.parents)
    keep = [False] * len(draft)
    for leaf in range(len(draft)):
        if leaf in inner:
            continue
        path, node = [], leaf
        while node != ROOT:
            path.append(node)
            node = draft.parents[node]
        path.reverse()
        for node in path[: grammar.valid([draft.tokens[k] for k in path])]:
            keep[node] = True
    return keep
