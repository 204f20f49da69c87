"""The fused forward's pieces (`Llama(fusion=...)`, rule in `lookahead.backends.choose_fusion`): merged projection
weights, and the small ops of a merged layer as Triton kernels ("triton") or as torch ops ("compile", which
`torch.compile` fuses).

Merged weights: a layer's q/k/v (and gate/up) weights live in one tensor, one GEMM computes them all, and the
Hugging Face-named parameters are views of their rows of it. Loading, `state_dict`, `named_parameters` and shape
checks see the usual names and shapes; the memory is the same 2 bytes a parameter in 16-bit. `.to()`, `to_empty`
and the like give each parameter a new tensor, so the owning module merges them again after each (`_apply`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lookahead.kernels import add_rms_norm, rotary_, silu_mul

from .rope import apply_rotary_qk, rotary_cos_sin


class MergedLinears(nn.Module):
    """A module whose linears named in `MERGED` (same input, outputs side by side) share one weight tensor,
    `merged_weight` [sum of out_features, in_features], and one `merged_bias` (None without biases)."""

    MERGED: tuple[str, ...] = ()

    def merge(self) -> bool:
        """Point the linears' parameters at rows of one new tensor each, unless they already are the rows of the
        merged tensors (a `.to()` that changed nothing keeps them, so CUDA graphs captured on them stay valid).
        Call after building, moving or replacing them; returns whether it made new tensors."""
        linears = [getattr(self, name) for name in self.MERGED]
        if not all(isinstance(linear, nn.Linear) for linear in linears):  # quantized (models.quantized): not merged
            merged = getattr(self, "merged_weight", None) is not None
            self.merged_weight = self.merged_bias = None
            return merged
        weights = [linear.weight for linear in linears]
        merged = getattr(self, "merged_weight", None)
        if merged is not None and merged.is_meta and all(w.is_meta for w in weights):
            return False  # released with its rows (`Llama.keep_weights_once`): nothing to merge
        biases = None if linears[0].bias is None else [linear.bias for linear in linears]
        if _rows_of(merged, weights) and (
                biases is None or _rows_of(getattr(self, "merged_bias", None), biases)):
            return False
        self.merged_weight = _merge(weights)
        self.merged_bias = None if biases is None else _merge(biases)
        return True

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.merge()  # a conversion that made new tensors gave each parameter its own
        return self


def _rows_of(merged: torch.Tensor | None, params: list[nn.Parameter]) -> bool:
    """Whether `params` are, in order, the consecutive rows of `merged` (same storage, dtype and device)."""
    if merged is None or any(p.dtype != merged.dtype or p.device != merged.device for p in params):
        return False
    if merged.device.type == "meta":
        return False  # no addresses to compare: meta tensors are merged again, which costs nothing
    offset, row = 0, merged.stride(0) * merged.element_size()
    for p in params:
        if p.data_ptr() != merged.data_ptr() + offset * row:
            return False
        offset += p.shape[0]
    return offset == merged.shape[0]


def _merge(params: list[nn.Parameter]) -> torch.Tensor:
    if params[0].device.type == "meta":  # no data to copy; and torch.cat on meta imports torch._dynamo (~75 MB)
        merged = torch.empty((sum(p.shape[0] for p in params), *params[0].shape[1:]), dtype=params[0].dtype,
                             device="meta")
    else:
        merged = torch.cat([p.detach() for p in params])  # one layer's transient copy, never the model's
    for p, rows in zip(params, merged.split([p.shape[0] for p in params]), strict=True):
        p.data = rows
    return merged


class TritonOps:
    """A merged layer's small ops as the fused Triton kernels (`fusion="triton"`): one launch each."""

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> None:
        self.inv_freq, self.positions = inv_freq, positions

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module):
        """(norm(residual + x), residual + x), the residual stream updated in place."""
        return add_rms_norm(x, norm.weight, norm.eps, residual)

    def rotary(self, q: torch.Tensor, k: torch.Tensor):
        return rotary_(q, k, self.positions, self.inv_freq)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


class TorchOps:
    """The same ops as torch ops (`fusion="compile"`: what `torch.compile` fuses; eager outside a runner's step)."""

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> None:
        # fp32 angles, cast once to the model dtype as transformers does; [(B,) T, 1, D] broadcasts over heads
        self.cos, self.sin = (c.to(dtype).unsqueeze(-2) for c in rotary_cos_sin(inv_freq, positions))

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module):
        h = x if residual is None else residual + x
        return norm(h), h

    def rotary(self, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary_qk(q, k, self.cos, self.sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
