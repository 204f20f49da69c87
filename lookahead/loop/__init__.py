"""The decode loop: the drivers for one prompt (`decode`) and a batch (`decode_batch`), their shared parts
(`core`: the model protocol, results, the lookahead state), the step's packing (`layout`), verification (`verify`),
sampling (`sampling`) and the 2D window (`window`)."""

from .batch import BatchStepModel, decode_batch
from .core import (
    PLAIN_STEP,
    GenerationResult,
    LookaheadLoop,
    Output,
    StepModel,
    StepOutput,
    first_token,
    path_step,
    static_steps,
    step_budget,
)
from .layout import StepLayout, full_pattern, pack_step
from .single import decode

__all__ = ["PLAIN_STEP", "BatchStepModel", "GenerationResult", "LookaheadLoop", "Output", "StepLayout", "StepModel",
           "StepOutput", "decode", "decode_batch", "first_token", "full_pattern", "pack_step", "path_step",
           "static_steps", "step_budget"]
