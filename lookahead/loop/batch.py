"""`decode_batch`: several prompts decoded together, each row exactly as it would be alone.

Every row keeps its own loop state (a `LookaheadLoop`: window, pool, drafts, sequence; its `Output`; its seed),
and the model keeps each row's L. A step packs every live row at the same static shape (the configuration's full
pattern, a self-tuned bucket's, or plain decoding's one token), runs them in one forward pass, verifies each row
on its own outputs and commits each row's accepted entries (different counts per row). A row that finishes (stop
token, token limit) leaves the batch before the next step: later steps spend nothing on it (`keep_rows`). Nothing in
a row depends on the other rows, so greedy rows equal their one-prompt generations token for token (in float32),
and a sampling row equals the one-prompt generation with its row seed.

It knows its model only through `BatchStepModel`, so tests drive it with a mock model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from lookahead.drafts import DraftMemory
from lookahead.kernels import StepPattern
from lookahead.request import Request
from lookahead.tuning import CostModel, StepBudget

from .core import (
    PLAIN_STEP,
    GenerationResult,
    LookaheadLoop,
    Output,
    StepOutput,
    first_token,
    sampling_seed,
    step_budget,
)
from .sampling import SampleRequest


class BatchStepModel(Protocol):
    """What the batched loop needs of a model with a KV cache of b rows (row b: sequence b, its own L).

    prefill_batch: run prompt b into row b; return the logits [b, V] of each prompt's last token.
    step_batch: run row b's `tokens[b]` laid out as `pattern` (one for every row, or one per row of a
        single shape: tree forms differ per row) at positions L_b + relative position; return one
        `StepOutput` per row, of its step indices `rows[b]` (the same count in every row), with topk > 0
        also every step index's top-k tokens, and with `sample` (one `SampleRequest` per row) their answers.
    commit_batch: keep row b's entries `step_indices[b]` at L_b, L_b + 1, ... (may be deferred to the
        next step, as `StepModel.commit`).
    keep_rows: continue with rows `order` only: row i becomes what row order[i] was.
    """

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def step_batch(self, tokens: Sequence[Sequence[int]], pattern: StepPattern | Sequence[StepPattern],
                   rows: Sequence[Sequence[int]], topk: int = 0,
                   sample: Sequence[SampleRequest] | None = None) -> list[StepOutput]: ...

    def commit_batch(self, step_indices: Sequence[Sequence[int]]) -> None: ...

    def keep_rows(self, order: Sequence[int]) -> None: ...


BatchStream = Callable[[int, list[int]], None]


def decode_batch(model: BatchStepModel, request: Request, stream: BatchStream | None = None, *,
                 cost: CostModel | None = None, memory: DraftMemory | None = None) -> list[GenerationResult]:
    """Generate for every prompt of the request; `request.lookahead` None means plain decoding.

    Every lookahead step is static (one shape in every row: the configuration's full pattern, or with a cost model
    and `budget="auto"` the bucket that pays most for the whole batch, chosen per step), so a generation has a few
    step shapes per batch size. stream: called as stream(prompt index, tokens) with each row's accepted tokens. memory:
    the drafting memory every row drafts from, read only, while the batch runs; all rows are added when it ends.
    """
    prompts, sampling = request.prompts, request.sampling
    seeds = [sampling_seed(request, i) for i in range(len(prompts))]
    outs = [Output(request.max_new_tokens, request.stop, None if stream is None else _row_stream(stream, i))
            for i in range(len(prompts))]
    logits = model.prefill_batch(prompts)
    last = [first_token(logits[i], sampling, seeds[i], len(prompts[i])) for i in range(len(prompts))]
    for out, token in zip(outs, last, strict=True):
        out.accept([token])
    loops = None if request.lookahead is None else [
        LookaheadLoop(request.lookahead, prompt, token, sampling, seed, static=True, memory=memory)
        for prompt, token, seed in zip(prompts, last, seeds, strict=True)]
    budget = None if loops is None else step_budget(loops[0], cost, seeds[0] is not None)
    live = list(range(len(prompts)))  # live[slot]: the prompt in the model's row `slot`
    while True:
        live = _drop_finished(model, live, outs)
        if not live:
            break
        if loops is None:
            _plain_step(model, live, last, outs, sampling, seeds, [len(p) for p in prompts])
        else:
            _lookahead_step(model, live, last, outs, loops, budget)
    for loop in loops or ():
        loop.remember()
    return [out.result for out in outs]


def _plain_step(model, live, last, outs, sampling, seeds, prompt_lengths) -> None:
    # row i's next token goes to absolute position: its prompt, then the tokens it has
    sample = {} if seeds[live[0]] is None else {
        "sample": [SampleRequest(sampling, seeds[i], (prompt_lengths[i] + len(outs[i].result.tokens),)) for i in live]}
    outputs = model.step_batch([[last[i]] for i in live], PLAIN_STEP, [[0]] * len(live), **sample)
    model.commit_batch([[0]] * len(live))
    for i, output in zip(live, outputs, strict=True):
        last[i] = output.argmax[0] if seeds[i] is None else output.sampled[0]
        outs[i].accept([last[i]], 1)


def _lookahead_step(model, live, last, outs, loops, budget: StepBudget | None) -> None:
    drafts = [loops[i].draft() for i in live]
    length = max(loops[i].length for i in live)
    choice = None if budget is None else budget.choose([d.scores for d in drafts], loops[live[0]].branch_tokens,
                                                       length)
    layouts = [loops[i].pack(draft, choice) for i, draft in zip(live, drafts, strict=True)]
    # one configuration: the same optional requests (top-k, sampling) in every row
    requests = [loops[i].step_requests(layout) for i, layout in zip(live, layouts, strict=True)]
    optional = {"topk": requests[0]["topk"]} if "topk" in requests[0] else {}
    if "sample" in requests[0]:
        optional["sample"] = [request["sample"] for request in requests]
    # one shape for every row (static steps), but each row's tree, so its pattern, is its own
    start = 0.0 if budget is None else budget.clock()
    outputs = model.step_batch([layout.tokens for layout in layouts], [layout.pattern for layout in layouts],
                               [layout.rows for layout in layouts], **optional)
    seconds = 0.0 if budget is None else budget.clock() - start
    commits, accepted = [], 0
    for i, layout, output in zip(live, layouts, outputs, strict=True):
        verdict = loops[i].finish(layout, output)
        commits.append(layout.commit_indices(verdict))
        last[i] = verdict.tokens[-1]
        outs[i].accept(verdict.tokens, layout.pattern.num_tokens)
        accepted += len(verdict.tokens) - 1
    model.commit_batch(commits)
    if budget is not None:
        expected = sum(sum(draft.scores[: len(layout.tree)]) for draft, layout in zip(drafts, layouts, strict=True))
        budget.record(choice, len(layouts) * layouts[0].pattern.num_tokens, length, seconds, expected, accepted,
                      len(layouts))


def _drop_finished(model: BatchStepModel, live: list[int], outs: list[Output]) -> list[int]:
    """The live rows after dropping the finished ones. Each freed place below the new size is filled by a
    live row from above it, so only those rows' caches move."""
    alive = [slot for slot, i in enumerate(live) if not outs[i].done]
    if len(alive) == len(live) or not alive:
        return [live[slot] for slot in alive]
    size = len(alive)
    movers = iter(slot for slot in alive if slot >= size)
    order = [slot if not outs[live[slot]].done else next(movers) for slot in range(size)]
    model.keep_rows(order)
    return [live[slot] for slot in order]


def _row_stream(stream: BatchStream, row: int) -> Callable[[list[int]], None]:
    return lambda tokens: stream(row, tokens)
