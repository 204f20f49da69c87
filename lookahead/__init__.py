"""Lookahead decoding for LLaMA-family models: exact, no draft model.

    from lookahead import LookaheadConfig
    from lookahead.models import Llama
    model = Llama.from_pretrained(folder)
    result = model.generate(prompt_ids, max_new_tokens=256, lookahead=LookaheadConfig())
"""

from .config import LookaheadConfig
from .engine import GenerationResult, StepModel, decode
from .sampling import SamplingParams

__all__ = ["GenerationResult", "LookaheadConfig", "SamplingParams", "StepModel", "decode"]
