"""Self-tuned steps on a transformers model: the cost model its steps are sized by, kept per model between
generations (`model_state`), read from the disk cache or measured on the model before the first self-tuned
generation that needs it, as the native model does (`lookahead.models.tuning`; the files are
`lookahead.tuning.store`'s).

The measurement runs before the prompt's prefill, on the generation's own (empty) cache: a few passes of each step
size, each cropped away after, at length 0 and over `SPAN` placeholder positions (cropped away after too), so it
changes nothing the generation then computes. What to measure, how to time it and the key's common parts are
`lookahead.tuning.measure`'s, as for the native model; this says how a step runs on a transformers model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from lookahead.kernels import interpreting
from lookahead.loop import path_step, static_steps
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request
from lookahead.tuning import CostModel, Curve, buckets, knots_up_to
from lookahead.tuning import measure as shared
from lookahead.tuning.store import Saver

from .step_model import HFStepModel, max_positions

SPAN = 512  # the longer cache length timed (placeholder tokens prefilled for it): the cost per cached position


@dataclass
class ModelState:
    """What `lookahead.hf` keeps for one transformers model between generations (the native `Llama` keeps it on
    itself). cost_model: what a step costs on this machine, which self-tuned steps (`LookaheadConfig(budget="auto")`,
    the default) are sized by; None until the first such generation measures it or reads it from the cache; set one
    (with an empty key) to fix the costs."""

    cost_model: CostModel | None = None
    saver: Saver = field(default_factory=Saver)

    def __setattr__(self, name: str, value) -> None:
        if name == "cost_model" and value is not None:
            if not isinstance(value, CostModel):
                raise TypeError(f"cost_model must be a lookahead.tuning.CostModel or None, got {type(value).__name__}")
            value.check()
        super().__setattr__(name, value)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transformers model -> ModelState


def model_state(hf_model) -> ModelState:
    """The state `lookahead.hf` keeps for `hf_model` (made on first use, dropped with the model)."""
    state = _STATES.get(hf_model)
    if state is None:
        state = _STATES.setdefault(hf_model, ModelState())
    return state


def cost_model_for(step_model: HFStepModel, request: Request) -> CostModel | None:
    """The cost model a self-tuned request sizes its steps by (None for plain decoding or full-size steps), measuring
    what the model's lacks for it. Called before the prefill: the cache must be empty."""
    cfg = request.lookahead
    if not shared.self_tuned(cfg):
        return None
    state = model_state(step_model.model)
    sizes = knots_up_to(cfg.step_tokens, buckets(cfg) if request.static_step else ())
    source = shared.Source(lambda: cost_key(step_model), lambda: measure(step_model, request, sizes))
    state.cost_model = shared.cost_model_for(state.cost_model, cfg, shared.Wanted(request.sampling.greedy, sizes[-1]),
                                             source, state.saver)
    return state.cost_model


def save_if_due(step_model: HFStepModel) -> None:
    """Write the model's cost model back to its cache file, at most every `store.SAVE_EVERY` seconds."""
    state = model_state(step_model.model)
    state.saver.if_due(state.cost_model)


def measure(step_model: HFStepModel, request: Request, sizes: list[int]) -> Curve:
    """Time steps of `sizes` tokens (a path of drafts, with the request's top-k and sampling) on the step model's
    cache, each cropped away after, at length 0 and at a longer one (the cache filled with placeholder tokens, cropped
    away after), and fit a curve. Leaves the cache empty, as it found it."""
    if step_model.length:
        raise RuntimeError("measure runs before the prefill, on an empty cache")
    sample = None if request.sampling.greedy else request.sampling
    topk = static_steps(request.lookahead)[-1][2]
    longest = min(SPAN, max_positions(step_model.model) - max(sizes) - 1)

    def run(i: int, length: int) -> None:
        if step_model.length != length:  # time_steps goes length by length: filled once per length
            step_model.trim(0)
            if length:
                step_model.prefill([0] * length)
        tokens = sizes[i]
        positions = tuple(range(length + 1, length + tokens + 1))
        step_model.step([0] * tokens, path_step(tokens), list(range(tokens)), topk,
                        None if sample is None else SampleRequest(sample, 0, positions))  # its fetch waits
        step_model.commit([])  # crops the pass's entries away

    try:
        return shared.time_steps(run, shared.Passes(sizes, 1, longest, interpreting()))
    finally:
        step_model.trim(0)


def cost_key(step_model: HFStepModel) -> dict:
    """What a step's cost depends on, beyond the step: the cache file's key."""
    model, config = step_model.model, step_model.model.config
    shape = [getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "intermediate_size", "vocab_size")]
    return shared.cost_key(step_model.device, model.dtype, "hf:" + ("triton" if step_model.kernel else "torch"),
                           [config.model_type, model.num_parameters(), *shape], interpreting(), ("transformers",))
