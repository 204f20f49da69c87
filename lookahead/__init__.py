"""Lookahead decoding for LLaMA-family models: exact, no draft model.

    from lookahead import LookaheadConfig
    from lookahead.models import Llama
    model = Llama.from_pretrained(folder)
    result = model.generate(prompt_ids, max_new_tokens=256, lookahead=LookaheadConfig())

Importing this package loads only the configuration; the decode loop (`lookahead.engine`) is loaded
when one of its names is first used, so `import lookahead.kernels` stays free of the loop and the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import LookaheadConfig

if TYPE_CHECKING:
    from .engine import GenerationResult, StepModel, StepOutput, decode
    from .sampling import SamplingParams

_LOOP_NAMES = {"GenerationResult": "engine", "StepModel": "engine", "StepOutput": "engine", "decode": "engine",
               "SamplingParams": "sampling"}

__all__ = ["GenerationResult", "LookaheadConfig", "SamplingParams", "StepModel", "StepOutput", "decode"]


def __getattr__(name: str) -> Any:
    if name in _LOOP_NAMES:
        return getattr(importlib.import_module(f".{_LOOP_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
