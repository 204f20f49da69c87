"""Linears and an embedding whose weights stay GGUF-quantized in memory (`lookahead.kernels.quant`): a GGUF file's
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q6_K weight, packed once at load, multiplied by the CPU kernel with the
batch-invariant contract, and never held in floating point."""

from __future__ import annotations

import torch
from torch import nn

from lookahead.kernels import quant


class QuantLinear(nn.Module):
    """`nn.Linear` over a packed quantized weight: `weight` is the packed blob (a uint8 parameter, so that moving,
    tying, counting versions and state dicts see it), `bias` an ordinary float one or None. Its output is in the
    input's dtype; the product itself accumulates in float32 (`quant.gemm`). CPU only."""

    def __init__(self, blob: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        head = quant.header(blob)
        self.type_name, self.out_features, self.in_features = head.type_name, head.out_features, head.in_features
        self.weight = nn.Parameter(blob, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quant.gemm(x.reshape(-1, self.in_features), [self.weight])
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}"


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a packed quantized weight (the rows looked up are dequantized as ggml does). Its output
    dtype follows the module's `.to(dtype)` (a 0-element float buffer carries it)."""

    def __init__(self, blob: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        head = quant.header(blob)
        self.type_name, self.num_embeddings, self.embedding_dim = head.type_name, head.out_features, head.in_features
        self.weight = nn.Parameter(blob, requires_grad=False)
        self.register_buffer("dtype_carrier", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant.rows(self.weight, ids).to(self.dtype_carrier.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.type_name}"


def quantized(module: nn.Module) -> bool:
    return isinstance(module, (QuantLinear, QuantEmbedding))
