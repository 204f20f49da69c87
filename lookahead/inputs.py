"""What `Llama.generate` and `lookahead.hf.generate` accept as a prompt and as stop tokens, checked and
turned into plain ints. `name` is the caller's argument name, for the messages.

A prompt may come as transformers hands it over: a list of ints, a 1-D or [1, T] integer tensor (what
`apply_chat_template(..., return_tensors="pt")` gives), or a `BatchEncoding` / dict holding `input_ids`
(and, optionally, an all-ones `attention_mask`). Nothing here imports transformers.

A batch (`Llama.generate` only) is a list or tuple of prompts, each a list of ints or a 1-D (or [1, T])
integer tensor; a flat list of ints is one prompt. `prompt_batch` tells them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def prompt_tokens(prompt_ids: Any, vocab_size: int, name: str = "prompt_ids") -> list[int]:
    """The prompt as a non-empty list of token ids in [0, vocab_size); a clear error for anything else."""
    if isinstance(prompt_ids, Mapping):
        prompt_ids = _from_encoding(prompt_ids, name)
    if isinstance(prompt_ids, torch.Tensor):
        prompt = _from_tensor(prompt_ids, name)
    elif isinstance(prompt_ids, (list, tuple)):
        prompt = _from_sequence(prompt_ids, name)
    else:
        raise TypeError(f"{name} must be a list of ints, a 1-D or [1, T] integer tensor, or a tokenizer's "
                        f"output holding 'input_ids'; got {type(prompt_ids).__name__}")
    if not prompt:
        raise ValueError(f"{name} is empty; give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return prompt


def prompt_batch(prompt_ids: Any, vocab_size: int, name: str = "prompt_ids") -> list[list[int]] | None:
    """The prompts of a batch as lists of ints, or None when `prompt_ids` is one prompt (for `prompt_tokens`).

    A list/tuple holding a list, tuple or tensor is a batch, so `[[1, 2, 3]]` is a batch of one; a flat
    list of ints, a tensor or a tokenizer's output is one prompt.
    """
    if not isinstance(prompt_ids, (list, tuple)):
        return None
    if not prompt_ids:
        raise ValueError(f"{name} is empty: give one prompt (a list of ints) or a batch (a list of prompts)")
    if not any(isinstance(p, (list, tuple, torch.Tensor)) for p in prompt_ids):
        return None
    ints = [i for i, p in enumerate(prompt_ids) if _is_int(p)]
    if ints:
        raise TypeError(f"{name} mixes token ids and prompts ({name}[{ints[0]}] is the int {prompt_ids[ints[0]]!r}): "
                        "give one prompt as a list of ints, or a batch as a list of prompts")
    return [_batch_row(p, vocab_size, f"{name}[{i}]") for i, p in enumerate(prompt_ids)]


def _batch_row(row: Any, vocab_size: int, name: str) -> list[int]:
    if isinstance(row, (list, tuple)):
        odd = next((t for t in row if not _is_int(t)), None)
        if odd is not None:
            raise TypeError(f"{name} must be a list of ints (one prompt of the batch), found "
                            f"{type(odd).__name__} {odd!r}")
    elif not isinstance(row, torch.Tensor):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor (one prompt of the batch), "
                        f"got {type(row).__name__}")
    return prompt_tokens(list(row) if isinstance(row, tuple) else row, vocab_size, name)


def eos_ids(config_eos: tuple[int, ...], eos_token_id: Any) -> tuple[int, ...]:
    """The token ids that end generation: `eos_token_id` if given (an int or a list of ints), else the config's."""
    if eos_token_id is None:
        return tuple(config_eos)
    return token_ids(eos_token_id, "eos_token_id")


def token_ids(value: Any, name: str) -> tuple[int, ...]:
    """An int or a list/tuple of ints (never bools or strings), all >= 0, as a tuple; `name` goes in the error."""
    if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.dtype == torch.bool):
        value = value.flatten().tolist()  # transformers keeps generation_config's eos ids as a tensor
    items = [value] if _is_int(value) else value
    if not isinstance(items, (list, tuple)) or not all(_is_int(t) for t in items):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    negative = [t for t in items if t < 0]
    if negative:
        raise ValueError(f"{name} must hold token ids >= 0, got {value!r}")
    return tuple(items)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _from_encoding(encoding: Mapping, name: str) -> Any:
    if "input_ids" not in encoding:
        raise TypeError(f"{name} is a mapping without 'input_ids' (keys: {sorted(map(str, encoding))})")
    mask = encoding.get("attention_mask")
    if mask is not None:
        values = mask.flatten().tolist() if isinstance(mask, torch.Tensor) else _flatten_one_row(mask, name)
        if any(v != 1 for v in values):
            raise ValueError(f"{name}['attention_mask'] is not all ones: generate takes one unpadded prompt")
    return encoding["input_ids"]


def _from_tensor(ids: torch.Tensor, name: str) -> list[int]:
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D or [1, T] tensor (one prompt, batch size 1), "
                         f"got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}")
    return ids.tolist()


def _from_sequence(ids: list | tuple, name: str) -> list[int]:
    if len(ids) == 1 and isinstance(ids[0], (list, tuple)):  # a batch of one, as some tokenizer calls return
        ids = ids[0]
    if not all(_is_int(t) for t in ids):
        odd = next(t for t in ids if not _is_int(t))
        raise TypeError(f"{name} must be a list of ints (one prompt), found {type(odd).__name__} {odd!r}")
    return list(ids)


def _flatten_one_row(values: Any, name: str) -> list:
    if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}['attention_mask'] must be a list or a tensor, got {type(values).__name__}")
    return list(values)
