"""Self-tuned steps on a transformers model: the cost model its steps are sized by, kept per model between
generations (`model_state`), read from the disk cache or measured on the model before the first self-tuned
generation that needs it, as the native model does (`lookahead.models.tuning`; the files are
`lookahead.tuning.store`'s).

The measurement runs before the prompt's prefill, on the generation's own (empty) cache: a few passes of each step
size, each cropped away after, so it changes nothing the generation then computes.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from lookahead.kernels import interpreting
from lookahead.loop import path_step, static_steps
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request
from lookahead.tuning import CostModel, Curve, buckets, fit, knots_up_to
from lookahead.tuning.store import Saver, device_label, prepared, versions

from .step_model import HFStepModel

REPEATS = 2  # timed passes per step size, after one that is not timed


@dataclass
class ModelState:
    """What `lookahead.hf` keeps for one transformers model between generations (the native `Llama` keeps it on
    itself). cost_model: what a step costs on this machine, which self-tuned steps (`LookaheadConfig(budget="auto")`,
    the default) are sized by; None until the first such generation measures it or reads it from the cache; set one
    (with an empty key) to fix the costs."""

    cost_model: CostModel | None = None
    saver: Saver = field(default_factory=Saver)


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
    if cfg is None or cfg.budget != "auto" or cfg.form != "tree":
        return None
    state = model_state(step_model.model)
    cost = state.cost_model
    if cost is not None and not cost.key:
        return cost  # the user's
    kind = "greedy" if request.sampling.greedy else "sampling"
    sizes = knots_up_to(cfg.step_tokens, buckets(cfg) if request.static_step else ())
    state.cost_model = prepared(cost, cost_key(step_model), kind, sizes[-1],
                                lambda: measure(step_model, request, sizes), state.saver)
    return state.cost_model


def save_if_due(step_model: HFStepModel) -> None:
    """Write the model's cost model back to its cache file, at most every `store.SAVE_EVERY` seconds."""
    state = model_state(step_model.model)
    state.saver.if_due(state.cost_model)


def measure(step_model: HFStepModel, request: Request, sizes: list[int]) -> Curve:
    """Time steps of `sizes` tokens (a path of drafts, with the request's top-k and sampling) on the step model's
    empty cache, each cropped away after, and fit a curve (its cost per cached position is learned as steps run)."""
    if step_model.length:
        raise RuntimeError("measure runs before the prefill, on an empty cache")
    sample = None if request.sampling.greedy else request.sampling
    topk = static_steps(request.lookahead)[-1][2]
    repeats = 1 if interpreting() else REPEATS
    samples = []
    for tokens in sizes:
        pattern = path_step(tokens)
        sample_request = None if sample is None else SampleRequest(sample, 0, tuple(range(1, tokens + 1)))
        for i in range(1 + repeats):  # the first pass is not timed: it prepares the shape
            start = time.perf_counter()
            step_model.step([0] * tokens, pattern, list(range(tokens)), topk, sample_request)
            if i:  # the step's fetch has waited for the device
                samples.append((tokens, 0, time.perf_counter() - start))
            step_model.commit([])  # crops the pass's entries away
    return fit(samples)


def cost_key(step_model: HFStepModel) -> dict:
    """What a step's cost depends on, beyond the step: the cache file's key."""
    model, config = step_model.model, step_model.model.config
    shape = [getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "intermediate_size", "vocab_size")]
    return {"device": device_label(step_model.device), "dtype": str(model.dtype),
            "backend": "hf:" + ("triton" if step_model.kernel else "torch"), "threads": torch.get_num_threads(),
            "interpreted": interpreting(), "model": [config.model_type, model.num_parameters(), *shape],
            "versions": [torch.__version__, *versions("triton", "lookahead", "transformers")]}
