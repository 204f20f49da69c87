"""The batch-invariant mode's GEMMs (`Llama(batch_invariant=True)`): every linear through
`lookahead.kernels.invariant_linear`, in float32.

A 16-bit model's GEMMs run in float32 from float32 copies of its weights (the same values, exactly), and their outputs
round to the model's dtype: a 16-bit output hides most differences of reduction order, so a check that a GEMM
computes every row alike can only be trusted on float32 outputs (`row_plans`), and a 16-bit GEMM accumulates in
float32 on every device anyway. The copies are made at first use and made again when a weight changes.
"""

from __future__ import annotations

import torch
from torch import nn

from lookahead.kernels.row_plans import invariant_linear


class InvariantLinears:
    """`linear(module, x)`: the module's `F.linear`, batch-invariant, in float32; its float32 weight copies."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(param) -> (version, address, float32 copy)

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if module.bias is None else self._float32(module.bias)
        return invariant_linear(x.float(), self._float32(module.weight), bias).to(x.dtype)

    def _float32(self, param: torch.Tensor) -> torch.Tensor:
        if param.dtype == torch.float32:
            return param
        kept = self._copies.get(id(param))
        if kept is None or kept[0] != param._version or kept[1] != param.data_ptr():
            kept = self._copies[id(param)] = (param._version, param.data_ptr(), param.float())
        return kept[2]
