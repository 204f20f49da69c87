"""The batch-invariant mode's GEMMs (`Llama(batch_invariant=True)`): every linear computes each row alike, whatever
rows come with it, and in float32.

On the CPU: `lookahead.kernels.cpu_gemm`, the package's own kernel, compiled once per machine into the cache folder
(each output a fused multiply-add chain over K in order; bfloat16 weights read as 16 bits). Where it cannot be built,
and on other devices: `lookahead.kernels.invariant_linear`, torch's GEMMs through row counts verified to compute every
row alike, in float32 from float32 copies of 16-bit weights (a 16-bit output hides most differences of reduction
order, so that check can only be trusted on float32 outputs). Either way a 16-bit model's GEMMs accumulate in float32
and round their outputs to its dtype, as a GPU's tensor cores do. Weight copies are made at first use, and again when a
weight changes.
"""

from __future__ import annotations

import torch
from torch import nn

from lookahead.kernels import cpu_gemm
from lookahead.kernels.row_plans import invariant_linear
from lookahead.paths import cache_root


class InvariantLinears:
    """`linear(module, x)`: the module's `F.linear`, batch-invariant, accumulated in float32."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, str], tuple[int, int, object]] = {}  # (id, kind) -> (version, address, copy)
        self._cpu_kernel: bool | None = None  # whether cpu_gemm is built (found out at the first CPU call)

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        if x.device.type == "cpu" and self._cpu_gemm():
            out = cpu_gemm.gemm(rows, self._copy(module.weight, "packed", cpu_gemm.pack))
        else:
            out = invariant_linear(rows, self._copy(module.weight, "float32", torch.Tensor.float))
        if module.bias is not None:
            out = out + module.bias.float()
        return out.to(x.dtype).view(*shape[:-1], out.shape[-1])

    def _cpu_gemm(self) -> bool:
        if self._cpu_kernel is None:
            root = cache_root()
            self._cpu_kernel = cpu_gemm.available(None if root is None else root / "kernels")
        return self._cpu_kernel

    def _copy(self, param: torch.Tensor, kind: str, make):
        if kind == "float32" and param.dtype == torch.float32:
            return param
        kept = self._copies.get((id(param), kind))
        if kept is None or kept[0] != param._version or kept[1] != param.data_ptr():
            kept = self._copies[(id(param), kind)] = (param._version, param.data_ptr(), make(param))
        return kept[2]
