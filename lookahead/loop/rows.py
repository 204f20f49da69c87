"""What the engine needs of a model: rows, each a sequence with its own KV cache, stepped together in packed steps.

A packed step is every live row's own step laid end to end: each row brings its tokens in its own layout (its
pattern: a lookahead step with its window, levels and tree, a plain one-token step, or a chunk of its prompt), its
output rows, whether it wants every token's top-k (recycling) and its sampling request. The model runs them in one
forward pass and returns one `StepOutput` per row. Rows are independent: a row's outputs depend on its own tokens
and cache only, so a row decodes exactly what it decodes alone, whatever shares its steps.

`SingleRowModel` turns a one-sequence `StepModel` (the transformers adapter, a mock) into a `RowModel` of one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lookahead.kernels import StepPattern

from .core import StepModel, StepOutput, path_step
from .sampling import SampleRequest


@dataclass(frozen=True)
class RowStep:
    """One row's part of a packed step.

    row: the model's row. tokens: [T] in `pattern`'s order. rows: the step indices whose logits come back, in order.
    topk: with > 0, every step index's top-k next tokens come back too (`StepOutput.topk`, [T, k]). sample: the
    row's sampling request (its winners come back as `StepOutput.sampled`). prefill: the tokens are the next chunk
    of the row's prompt, at positions L, L + 1, ... (`pattern` is `path_step(len(tokens))`: each sees the prefix and
    the chunk before it); its commit keeps them all.
    """

    row: int
    tokens: Sequence[int]
    pattern: StepPattern
    rows: Sequence[int]
    topk: int = 0
    sample: SampleRequest | None = None
    prefill: bool = False

    @staticmethod
    def chunk(row: int, tokens: Sequence[int], sample: SampleRequest | None = None) -> RowStep:
        """The next chunk of a row's prompt; its last token's output comes back (for the row's first new token)."""
        return RowStep(row, tokens, path_step(len(tokens)), [len(tokens) - 1], sample=sample, prefill=True)


class RowModel(Protocol):
    """What the engine needs of a model: rows of a KV cache, stepped together.

    admit: a row for a sequence that begins with `prompt` and may grow to `positions` positions (the prompt, the new
        tokens and the largest step's overhang), with its memory reserved up to there, or None while there is no room
        (the engine keeps the request waiting). Returns (row, cached): the prompt positions whose entries the row
        already holds (a prefix shared with earlier sequences), from which its prefill starts; at most
        len(prompt) - 1, since the prompt's last token must run for its logits.
    step: run every row's `RowStep` in one forward pass (each at positions L_row + relative position, its entries
        written after the row's cache prefix); one `StepOutput` per step, in order.
    commit: keep these step indices' entries of the row's last step at L, L + 1, ... and grow L by their number (may be
        deferred to the next step). A prefill chunk commits all its indices.
    release: the row is done (finished or cancelled): free its memory. Its entries may stay cached for later rows.
    prefill_chunk: the most prompt tokens one step may carry for one row (None: a whole prompt at once).
    A model whose rows' steps are bounded says so by a `max_step_tokens` attribute (the engine refuses requests whose
    lookahead steps would pass it).
    """

    prefill_chunk: int | None

    @property
    def device(self) -> torch.device: ...

    def admit(self, prompt: Sequence[int], positions: int) -> tuple[int, int] | None: ...

    def step(self, steps: Sequence[RowStep]) -> list[StepOutput]: ...

    def commit(self, row: int, step_indices: Sequence[int]) -> None: ...

    def release(self, row: int) -> None: ...


class SingleRowModel:
    """A `RowModel` of one row over a one-sequence `StepModel`: its prefill runs the whole prompt, its steps are the
    model's steps. A second row waits until the first is released."""

    prefill_chunk = None

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self.busy = False
        self._prefilled = False

    @property
    def device(self) -> torch.device:
        return getattr(self.model, "device", torch.device("cpu"))

    def admit(self, prompt: Sequence[int], positions: int) -> tuple[int, int] | None:
        if self.busy:
            return None
        self.busy = True
        return 0, 0

    def step(self, steps: Sequence[RowStep]) -> list[StepOutput]:
        (step,) = steps
        self._prefilled = step.prefill
        if not step.prefill:
            return [self.model.step(step.tokens, step.pattern, step.rows, step.topk, step.sample)]
        logits = self.model.prefill(step.tokens)[None]
        sampled = None if step.sample is None else step.sample.fetch(logits)
        return [StepOutput(logits, logits.argmax(-1).tolist(), None, sampled)]

    def commit(self, row: int, step_indices: Sequence[int]) -> None:
        if not self._prefilled:  # a prefill is in the model's cache already
            self.model.commit(step_indices)

    def release(self, row: int) -> None:
        self.busy = False
