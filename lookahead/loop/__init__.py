"""The decode loop: its one driver (`engine`: the `Engine`, with `decode` for one prompt over a one-sequence model and
`decode_batch` for a request's prompts over a `RowModel`), what its next step runs (`scheduler`: admission and each
row's part of the step), the requests inside it (`jobs`), what it needs of a model
(`rows`: `RowModel`, `RowStep`), the shared parts (`core`: the `StepModel` protocol, `StepOutput`, `GenerationResult`,
`Output`, `LookaheadLoop`), the step's packing and numbering (`layout`), verification (`verify`), sampling
(`sampling`), constrained decoding (`grammar`) and the 2D window (`window`)."""

from .core import (
    PLAIN_STEP,
    GenerationResult,
    LookaheadLoop,
    Output,
    StepModel,
    StepOutput,
    TokenLogprob,
    first_token,
    path_step,
    static_steps,
    step_budget,
)
from .engine import Capacity, Engine, QueueFull, decode, decode_batch
from .grammar import TokenGrammar
from .jobs import FINISH_REASONS, MAX_LOGPROBS, Delta, Handle
from .layout import StepLayout, full_pattern, pack_step
from .rows import RowModel, RowStep, SingleRowModel

__all__ = ["FINISH_REASONS", "MAX_LOGPROBS", "PLAIN_STEP", "Capacity", "Delta", "Engine", "GenerationResult", "Handle",
           "LookaheadLoop", "Output", "QueueFull", "RowModel", "RowStep", "SingleRowModel", "StepLayout", "StepModel",
           "StepOutput", "TokenGrammar", "TokenLogprob", "decode", "decode_batch", "first_token", "full_pattern",
           "pack_step", "path_step", "static_steps", "step_budget"]
