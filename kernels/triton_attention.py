"""Triton kernel of the lookahead/verification attention, with the pattern computed from (W, N, g).

FlashAttention-style forward (online softmax in exp2): one program owns a block of query rows of one
KV head. Its rows are (step token, query head) pairs packed token-major, so the GQA query heads that
share a KV head ride in the same tile and each K/V tile is loaded once per group. The cache prefix is
read block by block with no mask work (an unmasked loop plus one tail block); the step region tests
visibility with the integer rule of `_visible` (line for line `StepPattern.visible`) and skips key
blocks that no row of the block can see. No mask tensor exists on this path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .pattern import StepPattern

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


@triton.jit
def _visible(q_idx, k_idx, W: tl.constexpr, N: tl.constexpr):
    """Bool tile: step token q_idx attends to step token k_idx. Mirrors `StepPattern.visible`."""
    LA: tl.constexpr = W * (N - 1)
    q_la = q_idx < LA
    k_la = k_idx < LA
    q_level = q_idx // W
    q_col = q_idx % W
    k_level = k_idx // W
    k_col = k_idx % W
    # lookahead: level 0 columns up to the query's, and the query's own column up to its level
    lookahead = q_la & k_la & (((k_level == 0) & (k_col <= q_col)) | ((k_col == q_col) & (k_level <= q_level)))
    q_cand = (q_idx - LA) // (N - 1)
    k_cand = (k_idx - LA) // (N - 1)
    # candidates: the input token, and their own earlier tokens
    candidate = (q_idx >= LA) & ((k_idx == 0) | ((k_idx >= LA) & (k_cand == q_cand) & (k_idx <= q_idx)))
    return lookahead | candidate


@triton.jit
def _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: fold the scores qk [BLOCK_M, BLOCK_N] (log2 units) and v into acc."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # rows with nothing visible yet keep m = -inf; shift them by 0 so no inf - inf appears
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _lookahead_attn_fwd(
    Q, K, V, Out,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    prefix_len, qk_scale, H_KV,
    W: tl.constexpr, N: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    T: tl.constexpr = (W + G) * (N - 1)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = offs_m // GROUP  # [BLOCK_M] step index of each row
    q_head = h_kv * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_ok = q_idx < T
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + b * stride_qb + q_head[:, None] * stride_qh + q_idx[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + b * stride_kb + h_kv * stride_kh + offs_d[:, None] * stride_kd  # [BLOCK_D, 1]
    v_base = V + b * stride_vb + h_kv * stride_vh + offs_d[None, :] * stride_vd  # [1, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # cache prefix, full blocks: every step token sees all of it, so no masking work
    prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, prefix_full, BLOCK_N):
        k = tl.load(k_base + (start_n + offs_n)[None, :] * stride_kt, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_base + (start_n + offs_n)[:, None] * stride_vt, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # cache prefix, the tail block when prefix_len is not a multiple of BLOCK_N
    if prefix_full < prefix_len:
        n_ok = prefix_full + offs_n < prefix_len
        tail = prefix_full + offs_n
        k = tl.load(k_base + tail[None, :] * stride_kt, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_base + tail[:, None] * stride_vt, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # the step's own tokens: visible pairs come from (W, N, g); keys never come after the block's last row
    last_row = tl.minimum((pid_m + 1) * BLOCK_M - 1, GROUP * T - 1) // GROUP
    for start_n in range(0, last_row + 1, BLOCK_N):
        k_idx = start_n + offs_n  # [BLOCK_N] step index of each key
        vis = _visible(q_idx[:, None], k_idx[None, :], W, N) & row_ok[:, None] & (k_idx < T)[None, :]
        if tl.max(vis.to(tl.int32)) > 0:  # skip block pairs with nothing visible
            n_ok = k_idx < T
            k_pos = prefix_len + k_idx
            k = tl.load(k_base + k_pos[None, :] * stride_kt, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_base + k_pos[:, None] * stride_vt, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            qk = tl.where(vis, qk, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = Out + b * stride_ob + q_head[:, None] * stride_oh + q_idx[:, None] * stride_ot
    o_ptrs += offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(_lookahead_attn_fwd, triton.runtime.JITFunction)


def block_sizes(window: int, ngram: int, guesses: int, group: int, head_dim: int,
                dtype: torch.dtype = torch.float16) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a step: M tiles the (step token, query head) rows of one KV head."""
    rows = (window + guesses) * (ngram - 1) * group
    # bigger query tiles re-read each K/V tile fewer times; 128 x 64 is the tutorial's tile for D <= 128 in
    # 16-bit types (fp32 tiles take twice the shared memory: 64 rows keep D = 128 within an A100's 164 KB)
    wide = head_dim <= 128 and dtype != torch.float32
    block_m = min(128 if wide else 64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def launch_config(window: int, ngram: int, guesses: int, group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes, padded head dim, dot precision, warps and stages of one launch."""
    block_m, block_n = block_sizes(window, ngram, guesses, group, head_dim, dtype)
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",  # exact fp32, no silent TF32
        "num_warps": 8 if block_m * head_dim >= 128 * 128 else 4,
        "num_stages": 2,
    }


def _check_inputs(q, k, v, prefix_len, window, ngram, guesses, sm_scale) -> None:
    pattern = StepPattern(window, ngram, guesses)  # checks W >= 1, N >= 2, g >= 0 and their types
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"q, k, v must be 4-D [B, H, T, D] / [B, Hkv, S, D] with k.shape == v.shape; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, heads_q, tokens, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v batch and head dim must match q's ({batch}, {head_dim}); got k {tuple(k.shape)}")
    if heads_q % k.shape[1] != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of KV heads ({k.shape[1]})")
    if tokens != pattern.num_tokens:
        raise ValueError(
            f"q has {tokens} tokens; W={window}, N={ngram}, g={guesses} needs (W + g) * (N - 1) = {pattern.num_tokens}"
        )
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
    if prefix_len + tokens > k.shape[2]:
        raise ValueError(
            f"k/v hold {k.shape[2]} positions but prefix_len + T = {prefix_len} + {tokens} = {prefix_len + tokens}"
        )
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; use one of float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is larger than the kernel's maximum {_MAX_HEAD_DIM}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            "lookahead_attention got CPU tensors, but Triton runs on CPU only in its interpreter "
            "(set TRITON_INTERPRET=1 before importing triton); on CPU use reference_attention "
            "(the model's attn_backend='torch')"
        )
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive number or None, got {sm_scale!r}")


def lookahead_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    window: int,
    ngram: int,
    guesses: int,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention of one lookahead decoding step, its pattern computed from (W, N, g) in the kernel.

    Args:
        q: [B, Hq, T, D] the step's queries in DESIGN.md's layout, T = (window + guesses) * (ngram - 1).
        k, v: [B, Hkv, S, D], S >= prefix_len + T: the cache prefix (positions < prefix_len) followed by
            the step's keys/values. Only the first prefix_len + T positions are read, so a preallocated
            cache buffer can be passed as it is. Hq % Hkv == 0 (GQA/MQA).
        prefix_len: L, the tokens already in the cache (every step token sees all of them).
        window, ngram: W >= 1 and N >= 2; guesses: g >= 0, the candidates present in this step.
        sm_scale: softmax scale, default 1 / sqrt(D).

    Returns:
        [B, Hq, T, D] in q's dtype (float16, bfloat16 or float32).
    """
    _check_inputs(q, k, v, prefix_len, window, ngram, guesses, sm_scale)
    batch, heads_q, tokens, head_dim = q.shape
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    config = launch_config(window, ngram, guesses, group, head_dim, q.dtype)
    grid = (triton.cdiv(tokens * group, config["BLOCK_M"]), batch * heads_kv)
    _lookahead_attn_fwd[grid](
        q, k, v, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        prefix_len, scale * 1.4426950408889634, heads_kv,
        W=window, N=ngram, G=guesses, GROUP=group, HEAD_DIM=head_dim, **config,
    )  # fmt: skip
    return out
