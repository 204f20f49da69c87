"""Lookahead decoding for LLaMA-family models: exact, no draft model.

    from lookahead import LookaheadConfig
    from lookahead.models import Llama
    model = Llama.from_pretrained(folder)
    result = model.generate(prompt_ids, max_new_tokens=256, lookahead=LookaheadConfig())

Sub-packages, one room each: `loop` (the decode loop and its drivers), `drafts` (what a step verifies), `parallel`
(lookahead parallelism over several processes), `hf` (the transformers adapter), `cli` (the `lookahead` command);
`lookahead.kernels` and `lookahead.models` are installed from the top-level `kernels/` and `models/` folders.

Importing this package loads only the configuration; the loop's names (`decode`, `Request`, ...) load on first use,
so `import lookahead.kernels` stays free of the loop and the model.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import LookaheadConfig

if TYPE_CHECKING:
    from .loop import GenerationResult, StepModel, StepOutput, decode, decode_batch
    from .request import Request, SamplingParams

_LAZY = {"GenerationResult": "loop", "StepModel": "loop", "StepOutput": "loop", "decode": "loop",
         "decode_batch": "loop", "Request": "request", "SamplingParams": "request"}

__all__ = ["GenerationResult", "LookaheadConfig", "Request", "SamplingParams", "StepModel", "StepOutput", "decode",
           "decode_batch"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_one_checkout() -> None:
    """`lookahead.kernels` and `lookahead.models` come from the top-level `kernels/` and `models/` folders of the same
    checkout (or the same installed package) as this one; an editable install of another checkout that shadows one
    of them would mix two versions silently, so it fails here, at once."""
    from .folders import FOLDERS

    home = Path(__file__).resolve().parent
    for name in (package.removeprefix(f"{__name__}.") for package in FOLDERS if package != __name__):
        spec = importlib.util.find_spec(f"{__name__}.{name}")
        if spec is None or spec.origin is None:
            continue  # not installed: its own import fails with a clear error
        folder = Path(spec.origin).resolve().parent
        if folder.parent not in (home, home.parent):
            raise ImportError(f"lookahead.{name} resolves to {folder}, which is not part of this lookahead ({home}): "
                              "two checkouts are installed over each other; reinstall one with pip install -e .")


_check_one_checkout()
