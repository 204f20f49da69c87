"""The batched decode loop: several prompts decoded together, each row exactly as it would be alone.

Every row keeps its own loop state (the `_LookaheadLoop` of `engine.py`: window, pool, sequence; its
`_Output`; its `Sampler`), and the model keeps each row's L. A step packs every live row at the same
static shape (the configuration's full pattern, or plain decoding's one token), runs them in one
forward pass, verifies each row on its own outputs and commits each row's accepted entries (different
counts per row). A row that finishes (EOS, token limit) leaves the batch before the next step: later
steps spend nothing on it (`keep_rows`). Nothing in a row depends on the other rows, so greedy rows
equal their one-prompt generations token for token (in float32), and a sampling row equals the
one-prompt generation with its row seed.

It knows its model only through `BatchStepModel`, so tests drive it with a mock model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from lookahead.kernels import StepPattern

from .config import LookaheadConfig
from .engine import GREEDY, PLAIN_STEP, GenerationResult, StepOutput, _choose, _LookaheadLoop, _Output
from .layout import StepLayout
from .sampling import Sampler, SampleRequest, SamplingParams

SEED_SPAN = 2**64  # Sampler's seed range

# The adaptive default, `lookahead="auto"`: per-row configurations from the largest step down, each taken
# while the batch's tokens per forward pass, b * (W + G)(N - 1), stay within the device's budget of tokens
# that cost about one token's forward pass; plain decoding when none fits.
AUTO_LADDER = ((15, 5, 15), (7, 5, 7), (5, 4, 5), (3, 4, 3), (2, 3, 2))
# CPU, measured (bench/batch.py; bench/results/batch-cpu.json: default model, fp32, 2-core CPU, 16 dev
# prompts, 128 tokens): no lookahead step paid at any batch size (W=3, N=4, G=3: 0.47-0.73x plain's tokens/s
# for b = 1..16; 2-3-2: 0.48-0.90x; one prompt with exact-size steps: 0.85x), so the budget is 0: plain.
# GPU: not measured here (no GPU was lent); a forward of a few hundred tokens costs about one of a single
# token there (the paper's A100 settings run 120-token steps), hence 256.
AUTO_TOKEN_BUDGET = {"cpu": 0, "cuda": 256}


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


def row_seeds(seed: int | Sequence[int] | None, rows: int) -> list[int | None]:
    """Each row's sampling seed: a list gives them as they are (one per row); an int s gives row i the seed
    s + i (mod 2**64), so row i samples exactly as `generate(prompts[i], seed=s + i)` alone; None draws fresh
    ones."""
    if seed is None:
        return [None] * rows
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed < SEED_SPAN:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        return [(seed + i) % SEED_SPAN for i in range(rows)]
    if not isinstance(seed, (list, tuple)):
        raise TypeError(f"seed must be an int, a list of ints (one per prompt) or None, got {type(seed).__name__}")
    if len(seed) != rows:
        raise ValueError(f"seed holds {len(seed)} seeds for {rows} prompts; give one per prompt (or one int)")
    for i, s in enumerate(seed):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < SEED_SPAN:
            raise ValueError(f"seed[{i}] must be an int in [0, 2**64), got {s!r}")
    return list(seed)


def auto_lookahead(batch: int, device_type: str) -> LookaheadConfig | None:
    """The per-row lookahead configuration for `batch` prompts on `device_type` ("cpu", "cuda"), or None (plain).

    The largest of `AUTO_LADDER` whose b * (W + G)(N - 1) fits `AUTO_TOKEN_BUDGET[device_type]`. On a CPU
    (measured): plain decoding at every batch size. On CUDA (not measured): 15-5-15 for b <= 2, 7-5-7 for
    b = 3..4, 5-4-5 for b = 5..8, 3-4-3 up to 14, 2-3-2 up to 32, plain above.
    """
    budget = AUTO_TOKEN_BUDGET.get(device_type, 0)
    for window, ngram, guesses in AUTO_LADDER:
        if batch * (window + guesses) * (ngram - 1) <= budget:
            return LookaheadConfig(window, ngram, guesses)
    return None


def decode_batch(
    model: BatchStepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    lookahead: LookaheadConfig | None = None,
    eos_token_ids: Iterable[int] = (),
    stream: Callable[[int, list[int]], None] | None = None,
    seeds: Sequence[int | None] | None = None,
    device: torch.device | str = "cpu",
    drop_finished: bool = True,
) -> list[GenerationResult]:
    """Generate up to `max_new_tokens` after each of `prompts`; lookahead None means plain decoding.

    Every lookahead step is static (the configuration's full pattern in every row), so a generation has
    one step shape per batch size. stream: called as stream(prompt index, tokens) with each row's accepted
    tokens. seeds: one per prompt (see `row_seeds`). drop_finished: finished rows leave the batch (the
    default; False keeps stepping them as padding, only to measure what dropping saves: at b = 8 on the dev
    prompts, dropping gave 1.18x the tokens/s of padding for plain decoding and 1.38x for lookahead).
    """
    eos = frozenset(eos_token_ids)
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    samplers = [None if sampling.greedy else Sampler(s, torch.device(device)) for s in seeds]
    outs = [_Output(max_new_tokens, eos, None if stream is None else _row_stream(stream, i))
            for i in range(len(prompts))]
    logits = model.prefill_batch(prompts)
    last = [_choose(logits[i][None], sampling, samplers[i]) for i in range(len(prompts))]
    for out, token in zip(outs, last, strict=True):
        out.accept([token])
    loops = None if lookahead is None else [
        _LookaheadLoop(lookahead, prompt, token, sampling, sampler, static=True)
        for prompt, token, sampler in zip(prompts, last, samplers, strict=True)]
    live = list(range(len(prompts)))  # live[slot]: the prompt in the model's row `slot`
    padding: dict[int, tuple[list[int], list[int]]] = {}  # finished rows kept as padding: their last step
    while True:
        if drop_finished:
            live = _drop_finished(model, live, outs)
        if not any(not outs[i].done for i in live):
            break
        if loops is None:
            _plain_step(model, live, last, outs, sampling, samplers)
        else:
            _lookahead_step(model, live, last, outs, loops, padding)
    return [out.result for out in outs]


def _plain_step(model, live, last, outs, sampling, samplers) -> None:
    sample = {} if samplers[live[0]] is None else {
        "sample": [SampleRequest(sampling, samplers[i], first_draft_row=1) for i in live]}
    outputs = model.step_batch([[last[i]] for i in live], PLAIN_STEP, [[0]] * len(live), **sample)
    model.commit_batch([[0]] * len(live))
    for i, output in zip(live, outputs, strict=True):
        if outs[i].done:
            continue  # padding (drop_finished=False)
        last[i] = output.argmax[0] if samplers[i] is None else output.sampled.draws[0]
        outs[i].accept([last[i]])


def _lookahead_step(model, live, last, outs, loops, padding) -> None:
    layouts: list[StepLayout | None] = [None if outs[i].done else loops[i].plan(last[i]) for i in live]
    steps = [padding[i] if layout is None else (layout, layout.tokens, layout.rows, layout.pattern)
             for i, layout in zip(live, layouts, strict=True)]
    # one configuration: the same optional requests (top-k, sampling) in every row, padding rows included
    requests = [loops[i].step_requests(layout) for i, (layout, *_) in zip(live, steps, strict=True)]
    optional = {"topk": requests[0]["topk"]} if "topk" in requests[0] else {}
    if "sample" in requests[0]:
        optional["sample"] = [request["sample"] for request in requests]
    # one shape for every row (static steps), but a tree form's pattern differs from row to row
    outputs = model.step_batch([tokens for _, tokens, _, _ in steps], [pattern for *_, pattern in steps],
                               [rows for _, _, rows, _ in steps], **optional)
    commits = []
    for i, layout, output, step in zip(live, layouts, outputs, steps, strict=True):
        if layout is None:
            commits.append([0])  # padding: keep one entry, like a plain step
            continue
        verdict = loops[i].finish(layout, output)
        commits.append(layout.commit_indices(verdict.candidate, verdict.run))
        last[i] = verdict.tokens[-1]
        outs[i].accept(verdict.tokens)
        if outs[i].done:
            padding[i] = step
    model.commit_batch(commits)


def _drop_finished(model: BatchStepModel, live: list[int], outs: list[_Output]) -> list[int]:
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


def _row_stream(stream: Callable[[int, list[int]], None], row: int) -> Callable[[list[int]], None]:
    return lambda tokens: stream(row, tokens)
