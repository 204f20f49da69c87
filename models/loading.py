"""Loading Hugging Face-named safetensors weights (single file or sharded) into a module, checked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file or tensor."""


def checkpoint_files(folder: Path) -> dict[str, list[str]]:
    """{file name: tensor names it holds per the index} for a sharded checkpoint, {file: []} for a single file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (folder / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}: is this a safetensors checkpoint folder?")


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `folder`, one file open at a time."""
    for file, indexed_names in checkpoint_files(folder).items():
        path = folder / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} but does not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = set(f.keys())
                for name in indexed_names:
                    if name not in names:
                        raise CheckpointError(f"tensor {name!r} is listed in {INDEX_FILE} for {file} but is not in it")
                for name in sorted(names):
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {path}: {e} (is the file complete and a safetensors file?)") from None


def load_weights(module: nn.Module, folder: Path, optional: frozenset[str] = frozenset()) -> None:
    """Copy the checkpoint's tensors into `module`'s parameters (converting dtype), all or nothing checked.

    Every parameter must be present with its exact shape; names in `optional` may be absent or extra
    (a tied head, say). Unexpected or misshapen tensors raise `CheckpointError` naming them.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for name, tensor in iter_tensors(folder):
        if name not in params:
            if name in optional or name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} in {folder}: not a parameter of this LLaMA model")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(target.shape)} (does config.json match the weights?)")
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen - optional)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {folder} is missing tensor(s) {shown}{more}")
