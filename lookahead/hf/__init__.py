"""`lookahead.hf`: this package's decode loop on a Hugging Face transformers causal LM, no patching.

    import lookahead.hf
    out = lookahead.hf.generate(hf_model, input_ids, max_new_tokens=256, lookahead=LookaheadConfig())
    ids = hf_model.generate(input_ids, custom_generate=lookahead.hf.custom_generate, max_new_tokens=256)

`HFStepModel` speaks the loop's `StepModel` protocol over a transformers model and its `DynamicCache`
through the two hooks transformers supports: an attention function registered with
`AttentionInterface` (it receives q, k, v after RoPE and after the cache update; the step's pattern
reaches it as a forward keyword argument) and `generate(custom_generate=...)`. The model's
attention implementation is switched to it only for the duration of a step and restored after, so
the model is left as it was; the switch is invisible to other callers of the model meanwhile (a plain
`generate` in another thread runs the model's own attention and mask; see `step_model`).
transformers is imported here only, on first use.
"""

from .api import custom_generate, generate
from .step_model import ATTENTION_NAME, MIN_TRANSFORMERS, HFStepModel, check_model, require_transformers
from .tuning import ModelState, model_state

__all__ = ["ATTENTION_NAME", "MIN_TRANSFORMERS", "HFStepModel", "ModelState", "check_model", "custom_generate",
           "generate", "model_state", "require_transformers"]
