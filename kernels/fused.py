"""Fused elementwise kernels of a LLaMA layer on Triton: residual add + RMSNorm, RoPE on q and k, SiLU(gate) * up.

Each replaces several small torch ops per layer with one launch and rounds where the torch ops round (the
references in `fused_reference.py` spell the torch ops out), so a fused forward gives the torch forward's logits
up to the last bit of a reduction or a transcendental. No kernel allocates anything that differs between calls or
reads a value on the host, so a CUDA graph captures them; each launches under its tensors' device
(`device_binding`). Hidden sizes need not be powers of two (blocks are masked).

Shapes: `add_rms_norm` x [..., C]; `rotary_` q [B, T, Hq, D] and k [B, T, Hkv, D] (any strides, D contiguous),
positions [T] or [B, T]; `silu_mul` gate_up [..., 2I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_kernels import interpreting
from .device import device_binding

__all__ = ["add_rms_norm", "rotary_", "silu_mul"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(X, RES, W, OUT, stride_x, stride_res, stride_out, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: h = x (+ res, rounded to the model dtype, written back to res), out = w * rms_norm(h) in fp32,
    the norm cast to the model dtype before the weight multiplies it (transformers' order)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = OUT.dtype.element_ty
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + res.to(tl.float32)).to(dtype)  # the torch add rounds to the model dtype
        tl.store(RES + row * stride_res + cols, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + row * stride_out + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(X, stride_h, heads, cos, sin, half_idx, half_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate `heads` heads of one token in place (rotate-half): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], each
    product rounded to the model dtype before the sum, as the torch ops (`x * cos + rotate_half(x) * sin`) do."""
    dtype = X.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & half_mask[None, :]  # [BLOCK_H, BLOCK_HALF]
    ptr = X + h[:, None] * stride_h + half_idx[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(ptr, out1.to(dtype), mask=mask)
    tl.store(ptr + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, POS, INV_FREQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_pb, stride_pt, tokens, heads_q, heads_k,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    """One token of one row: its angles pos x inv_freq in fp32, cos and sin rounded to the model dtype (as
    transformers casts them), then q's and k's heads rotated in place."""
    pid = tl.program_id(0)
    b = (pid // tokens).to(tl.int64)
    t = (pid % tokens).to(tl.int64)
    pos = tl.load(POS + b * stride_pb + t * stride_pt).to(tl.float32)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    angle = pos * tl.load(INV_FREQ + j, mask=j_mask, other=0.0)  # [BLOCK_HALF]
    dtype = Q.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(Q + b * stride_qb + t * stride_qt, stride_qh, heads_q, cos, sin, j, j_mask, HALF, BLOCK_HQ)
    _rotate_heads(K + b * stride_kb + t * stride_kt, stride_kh, heads_k, cos, sin, j, j_mask, HALF, BLOCK_HK)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    """One block of one row: silu(gate) rounded to the model dtype, times up (the torch ops' two roundings)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = OUT.dtype.element_ty
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `residual + x` in one launch: returns (normed, residual).

    x: [..., C] (rows of C contiguous values); weight: [C], x's dtype. residual: None (the first norm of a forward:
    x is the residual stream) or a contiguous tensor of x's shape and dtype, updated in place to residual + x (rounded
    to the dtype, as `residual + x` in torch) and returned. normed: a new [..., C], `weight * rms_norm(h.float())`
    cast to the dtype before the weight multiplies it (transformers' LlamaRMSNorm).
    """
    _check_float("x", x)
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{x.shape[-1]}] in {x.dtype}; got {list(weight.shape)} "
                         f"{weight.dtype} with stride {weight.stride()}")
    _check_device(x, weight=weight, residual=residual)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {list(x.shape)} {x.dtype} tensor; got "
                         f"{list(residual.shape)} {residual.dtype}")
    cols = x.shape[-1]
    rows = x.reshape(-1, cols)  # a view for the model's activations
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else x
    if rows.shape[0]:
        block = triton.next_power_of_2(cols)
        with device_binding(x.device):
            _add_rms_norm_kernel[(rows.shape[0],)](
                rows, res, weight, out, rows.stride(0), cols, cols, cols, eps,
                HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip
    return out, res


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings on q and k in place, in one launch (Hugging Face's rotate-half layout): returns (q, k).

    q: [B, T, Hq, D] and k: [B, T, Hkv, D], any strides with D contiguous (views of a merged q/k/v projection);
    positions: integer [T] (every row) or [B, T]; inv_freq: fp32 [D / 2]. The angles are positions x inv_freq in
    fp32; cos and sin are cast to q's dtype before they multiply it, as transformers does.
    """
    _check_float("q", q)
    if k.dtype != q.dtype or q.ndim != 4 or k.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q [B, T, Hq, D] and k [B, T, Hkv, D] must share B, T, D and dtype; got "
                         f"{list(q.shape)} {q.dtype} and {list(k.shape)} {k.dtype}")
    batch, tokens, _, head_dim = q.shape
    if head_dim % 2 or q.stride(3) != 1 or k.stride(3) != 1:
        raise ValueError(f"the head dim must be even and contiguous; got q {list(q.shape)} strides {q.stride()}, "
                         f"k strides {k.stride()}")
    if positions.dtype.is_floating_point or positions.shape not in ((tokens,), (batch, tokens)):
        raise ValueError(f"positions must be an integer [T] or [B, T] tensor with T = {tokens}, B = {batch}; got "
                         f"{list(positions.shape)} {positions.dtype}")
    if inv_freq.dtype != torch.float32 or inv_freq.shape != (head_dim // 2,) or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq must be a contiguous fp32 [{head_dim // 2}]; got {list(inv_freq.shape)} "
                         f"{inv_freq.dtype} with stride {inv_freq.stride()}")
    _check_device(q, k=k, positions=positions, inv_freq=inv_freq)
    if batch * tokens == 0:
        return q, k
    stride_pb = positions.stride(0) if positions.ndim == 2 else 0
    half = head_dim // 2
    with device_binding(q.device):
        _rotary_kernel[(batch * tokens,)](
            q, k, positions, inv_freq, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            stride_pb, positions.stride(-1), tokens, q.shape[2], k.shape[2],
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(q.shape[2]),
            BLOCK_HK=triton.next_power_of_2(k.shape[2]), num_warps=4,
        )  # fmt: skip
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in one launch, from a merged gate/up projection.

    gate_up: [..., 2I], the gate in its first I columns and up in the last I, rows of 2I contiguous values.
    Returns a new [..., I] in its dtype: `F.silu(gate) * up` as the torch ops round it.
    """
    _check_float("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up); got {list(gate_up.shape)}")
    cols = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and cols:
        with device_binding(gate_up.device):
            _silu_mul_kernel[(rows.shape[0], triton.cdiv(cols, _SILU_BLOCK))](
                rows, out, rows.stride(0), cols, cols, BLOCK=_SILU_BLOCK, num_warps=4,
            )  # fmt: skip
    return out


def _warps(block: int) -> int:
    """Warps of a one-row kernel: about 8 to 16 fp32 values per thread (4096 columns: 8 warps)."""
    return max(1, min(16, block // 512))


def _check_device(x: torch.Tensor, **others: torch.Tensor | None) -> None:
    """A launch reads every tensor through raw pointers on x's device: one elsewhere would be an illegal access."""
    for name, other in others.items():
        if other is not None and other.device != x.device:
            raise ValueError(f"{name} is on {other.device}, the activations on {x.device}: move it there")


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32; got {x.dtype}")
    if x.device.type == "cpu" and not interpreting():
        raise ValueError(f"{name} is on the CPU, where Triton runs only in its interpreter (set TRITON_INTERPRET=1 "
                         "before importing triton); on a CPU use the torch ops (`lookahead.kernels.fused_reference`)")
