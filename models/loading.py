"""Loading Hugging Face-named safetensors weights (single file or sharded) into a module, checked; and a model from a
checkpoint folder (`load_folder`)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import LlamaConfig
from .rope import inverse_frequencies

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def load_folder(cls, folder: Path, dtype: torch.dtype, device: torch.device, **options) -> nn.Module:
    """A `cls` (Llama, built with `options`) with a Hugging Face checkpoint folder's weights, in `dtype` on `device`.
    With tie_word_embeddings and both embed_tokens and lm_head in the file, does what transformers does: ties them if
    they are equal, else keeps the file's lm_head and warns."""
    config = LlamaConfig.from_file(folder)
    names = tensor_names(folder)
    check_layer_count(names, config.num_hidden_layers, folder)  # before building: a damaged count takes hours
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    both_in_file = config.tie_word_embeddings and head in names and embed in names
    if both_in_file:  # load both; tied again below only if they are equal (transformers' rule)
        config = dataclasses.replace(config, tie_word_embeddings=False)
    with torch.device("meta"):
        model = cls(config, **options)
    check_shapes(model, folder)  # before allocating: a config.json's absurd size is refused, not allocated
    # the dtype first, on meta (free), then memory at that dtype: ~2 bytes per parameter in 16-bit, where
    # materialising fp32 and casting peaks at 4 + 2 (out of memory for a 34B model on an 80 GB GPU)
    # (`to_empty` would do it through torch.empty_like on meta tensors, which imports sympy and torch's symbolic
    # shapes: ~50 MB resident for nothing, so each tensor is made by torch.empty)
    model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model._tie_weights()  # the conversion gives each module its own new tensor
    model.rope_inv_freq = inverse_frequencies(config.head_dim, config.rope).to(device)  # fp32 always
    # tied: the one shared tensor may come from either name (transformers swaps them if only the head is there)
    optional = frozenset({embed if head in names else head}) if config.tie_word_embeddings else frozenset()
    load_weights(model, folder, optional=optional)
    if both_in_file:
        if torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
            model.config = dataclasses.replace(config, tie_word_embeddings=True)
            model._tie_weights()
        else:
            warnings.warn(f"{folder / 'config.json'} sets tie_word_embeddings, but the checkpoint holds an "
                          f"lm_head.weight that differs from embed_tokens: keeping both, untied, as transformers "
                          "does (set tie_word_embeddings to false to silence this)", stacklevel=3)
    return model


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file or tensor."""


def checkpoint_files(folder: Path) -> dict[str, list[str]]:
    """{file name: tensor names it holds per the index} for a sharded checkpoint, {file: []} for a single file.

    The index may name only files inside `folder` (no absolute paths, no `..`).
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e!r}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must be an object {{tensor: file}}, got {weight_map!r:.80}")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _inside(file):
                raise CheckpointError(f"{index} assigns tensor {name!r} to {file!r}: only files inside the "
                                      "checkpoint folder may be named (a relative path without '..')")
            files.setdefault(file, []).append(name)
        return files
    if (folder / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}: is this a safetensors checkpoint folder?")


def tensor_names(folder: Path) -> set[str]:
    """Names of the checkpoint's tensors, read from the file headers only."""
    return {name for name, _ in _iter_files(folder, read=False)}


def check_layer_count(names: set[str], layers: int, folder: Path) -> None:
    """Before the model is built: config.json's num_hidden_layers must not exceed the layers the checkpoint holds
    (`model.layers.<i>.*` names). Building a model of a damaged count (2**30 layers) would take hours and memory."""
    held = {int(m.group(1)) for m in map(_LAYER_NAME.match, names) if m}
    if layers > len(held):
        raise CheckpointError(f"config.json sets num_hidden_layers {layers}, but the checkpoint in {folder} holds "
                              f"{len(held)} layer(s) (does config.json match the weights?)")


def check_shapes(module: nn.Module, folder: Path) -> None:
    """Before any weight is allocated: every checkpoint tensor that names a parameter of `module` (built on the
    meta device, say) has that parameter's shape, read from the file headers only. A config.json whose sizes
    disagree with the weights (a vocab_size of 2**30, say) is refused here rather than allocated."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, shape in _iter_files(folder, read=False):
        if name in params and shape != tuple(params[name].shape):
            raise _shape_error(name, shape, params[name])


def _shape_error(name: str, shape: tuple[int, ...], target: torch.Tensor) -> CheckpointError:
    return CheckpointError(f"tensor {name!r} has shape {shape}, the model expects {tuple(target.shape)} "
                           "(does config.json match the weights?)")


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `folder`, one file open at a time.

    In a sharded checkpoint every tensor must sit in the shard the index assigns it to.
    """
    yield from _iter_files(folder, read=True)


def _iter_files(folder: Path, read: bool) -> Iterator[tuple[str, torch.Tensor | tuple[int, ...]]]:
    """(name, tensor) for every tensor, or (name, shape) from the headers only when not `read`."""
    files = checkpoint_files(folder)
    sharded = (folder / INDEX_FILE).is_file()
    for file, indexed_names in files.items():
        path = folder / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} but does not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = set(f.keys())
                for name in indexed_names:
                    if name not in names:
                        raise CheckpointError(f"tensor {name!r} is listed in {INDEX_FILE} for {file} but is not in it")
                if sharded:
                    stray = sorted(names - set(indexed_names))
                    if stray:
                        raise CheckpointError(f"tensor {stray[0]!r} is in {file}, but {INDEX_FILE} does not assign it "
                                              f"to that file ({len(stray)} such tensor(s))")
                for name in sorted(names):
                    yield name, (f.get_tensor(name) if read else tuple(f.get_slice(name).get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {path}: {e} (is the file complete and a safetensors file?)") from None


def _inside(file: str) -> bool:
    """A relative path that stays inside the folder (judged on the name: symlinks, as in the HF cache, are fine)."""
    pure = PurePosixPath(file.replace("\\", "/"))
    return bool(file) and not pure.is_absolute() and not PureWindowsPath(file).drive and ".." not in pure.parts


def load_weights(module: nn.Module, folder: Path, optional: frozenset[str] = frozenset()) -> None:
    """Copy the checkpoint's tensors into `module`'s parameters (converting dtype), all or nothing checked.

    Every parameter must be present, floating point, with its exact shape and only finite values; names in
    `optional` may be absent or extra (a tied head, say). Unexpected, misshapen, integer, bool or non-finite
    tensors raise `CheckpointError` naming them.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for name, tensor in iter_tensors(folder):
        if name not in params:
            if name in optional or name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} in {folder}: not a parameter of this LLaMA model")
        target = params[name]
        if not tensor.is_floating_point():  # copy_ would convert ints and bools silently
            raise CheckpointError(f"tensor {name!r} in {folder} holds {tensor.dtype} values, not floating point: "
                                  "the checkpoint is damaged or quantized in a format this loader does not read")
        if tuple(tensor.shape) != tuple(target.shape):
            raise _shape_error(name, tuple(tensor.shape), target)
        if not _all_finite(tensor):
            raise CheckpointError(f"tensor {name!r} in {folder} holds NaN or inf values: the checkpoint is damaged")
        with torch.no_grad():
            target.copy_(tensor)
        if target.dtype != tensor.dtype and not _all_finite(target):
            raise CheckpointError(f"tensor {name!r} overflows {target.dtype} (values up to "
                                  f"{tensor.abs().max().item():.3g}); load it in a wider dtype such as float32")
        seen.add(name)
    missing = sorted(set(params) - seen - optional)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {folder} is missing tensor(s) {shown}{more}")


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf: a finite sum proves it in one cheap pass; only a non-finite sum needs the exact check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
