"""`decode`: one prompt, plain or lookahead decoding, over any model that implements `StepModel`."""

from __future__ import annotations

from lookahead.drafts import DraftMemory
from lookahead.request import Request
from lookahead.tuning import CostModel

from .core import (
    PLAIN_STEP,
    GenerationResult,
    LookaheadLoop,
    Output,
    StepModel,
    Stream,
    first_token,
    sampling_seed,
    step_budget,
)
from .sampling import SampleRequest


def decode(model: StepModel, request: Request, stream: Stream | None = None, *, cost: CostModel | None = None,
           memory: DraftMemory | None = None) -> GenerationResult:
    """Generate for the request's one prompt; `request.lookahead` None means plain decoding.

    request.static_step: feed every lookahead step at a static shape (the configuration's full size
    (W + G)(N - 1), or a self-tuned bucket's), missing levels and nodes padded; otherwise each step has the exact
    size of what it holds. The tokens are the same either way. stream: called with each step's accepted tokens.
    cost: the machine's cost model, which sizes each step when the configuration's budget is "auto" (None: full-size
    steps); it learns from this generation's steps. memory: the drafting memory to draft from and add to (with
    `LookaheadConfig.warm`); it changes drafts only, never tokens.
    """
    (prompt,) = request.prompts
    sampling = request.sampling
    seed = sampling_seed(request, 0)
    out = Output(request.max_new_tokens, request.stop, stream)
    last = first_token(model.prefill(prompt), sampling, seed, len(prompt))
    out.accept([last])
    if request.lookahead is None:
        while not out.done:
            position = len(prompt) + len(out.result.tokens)  # where the next token goes
            sample = {} if seed is None else {"sample": SampleRequest(sampling, seed, (position,))}
            step = model.step([last], PLAIN_STEP, [0], **sample)
            model.commit([0])
            last = step.argmax[0] if seed is None else step.sampled[0]
            out.accept([last], 1)
    else:
        loop = LookaheadLoop(request.lookahead, prompt, last, sampling, seed, request.static_step, memory)
        budget = step_budget(loop, cost, seed is not None)
        while not out.done:
            verdict, layout = loop.step(model, budget)
            out.accept(verdict.tokens, layout.pattern.num_tokens)
        loop.remember()
    return out.result
