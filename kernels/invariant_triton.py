"""The batch-invariant attention as a Triton kernel: `invariant_attention(q, k_all, v_all, slots, counts)`.

The same contract as `block_attention` (a query's keys laid out by position, reduced in blocks of `BLOCK` positions
aligned to position 0, the softmax's max over every visible score, the blocks' partial sums added one after another),
with each query's key slots given as a list: `slots[i, :counts[i]]` are query i's keys in position order (its prefix,
then its ancestors). One program per (query, KV head) reduces the query heads of its group. Every program runs the
same code on blocks of the same shape, and a block's sums (over D, over the block's 16 keys) are the same
`tl.sum` trees whatever the query's length, so a query's output depends on its own keys alone. In float32 throughout
(`tl.sum` of products, no `tl.dot`: a tensor core's accumulation order is the hardware's). Its sums within a block are
`tl.sum` trees, not `block_attention`'s GEMMs: the two agree to rounding, each with itself bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_attention import BLOCK


@triton.jit
def _invariant_kernel(Q, K, V, Out, Slots, Counts, sm_scale, num_blocks,
                      stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ot, stride_oh,
                      stride_st,
                      GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    query = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, D_P2)
    j = tl.arange(0, BLOCK_K)
    g_ok = g < GROUP
    d_ok = d < D
    heads = kv_head * GROUP + g
    q = tl.load(Q + query * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * sm_scale  # [G, D]
    count = tl.load(Counts + query)
    # pass 1: the max over every visible score (exact in any order)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    for b in range(0, num_blocks):
        index = b * BLOCK_K + j
        visible = index < count
        slot = tl.load(Slots + query * stride_st + index, mask=visible, other=0)
        k = tl.load(K + kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BLOCK]
        s = tl.where(visible[None, :], s, float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    # pass 2: each block's weighted values and weight sum, added block after block
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    for b in range(0, num_blocks):
        index = b * BLOCK_K + j
        visible = index < count
        slot = tl.load(Slots + query * stride_st + index, mask=visible, other=0)
        k = tl.load(K + kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + kv_head * stride_vh + slot[:, None] * stride_vs + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        p = tl.where(visible[None, :], tl.exp(s - m[:, None]), 0.0)  # [G, BLOCK]
        acc += tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        total += tl.sum(p, axis=1)
    out = acc / total[:, None]
    tl.store(Out + query * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def invariant_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, slots: torch.Tensor,
                        counts: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """q [R, Hq, D] (query heads of a group adjacent: head h reads KV head h // (Hq / Hkv)); k_all, v_all
    [Hkv, S, D] (any strides with a unit last one); slots [R, width] int32/int64, query i's key slots in position order
    in its first counts[i] entries (width a multiple of `BLOCK`); counts [R] >= 1. Returns [R, Hq, D] in q's dtype."""
    r, heads, dim = q.shape
    kv_heads = k_all.shape[0]
    if heads % kv_heads or slots.shape != (r, slots.shape[1]) or slots.shape[1] % BLOCK or counts.shape != (r,):
        raise ValueError(f"invariant_attention: q {tuple(q.shape)}, k_all {tuple(k_all.shape)}, slots "
                         f"{tuple(slots.shape)}, counts {tuple(counts.shape)} do not fit together")
    if k_all.stride(-1) != 1 or v_all.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("invariant_attention: q, k_all and v_all need a unit stride on D")
    out = torch.empty_like(q)
    if r == 0:
        return out
    group = heads // kv_heads
    slots = slots.contiguous()
    _invariant_kernel[(r, kv_heads)](
        q, k_all, v_all, out, slots, counts.contiguous(), dim ** -0.5 if sm_scale is None else sm_scale,
        slots.shape[1] // BLOCK, q.stride(0), q.stride(1), k_all.stride(0), k_all.stride(1), v_all.stride(0),
        v_all.stride(1), out.stride(0), out.stride(1), slots.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=dim, D_P2=triton.next_power_of_2(dim), BLOCK_K=BLOCK)
    return out
