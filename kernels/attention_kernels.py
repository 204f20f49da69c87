"""Triton kernels of the lookahead attention: split-K over the cache prefix (flash-decoding), then a merge.

`_lookahead_attn_split` runs over (query tiles, B x Hkv, S + 1). A program owns a block of query rows of one
KV head; its rows are (step token, query head) pairs packed token-major, so the GQA heads that share a KV head
ride in one tile and each K/V tile is loaded once per group. Splits 0..S-1 each take an even share of the row's
cache prefix (per-row lengths are read from memory) with no mask work except the one tail block; split S takes
the step's own keys under the integer rule `_visible` (line for line `StepPattern.visible`) and skips key blocks
that no row of the tile can see. Each program writes an fp32 partial output and its log-sum-exp (log2 units);
splits with nothing to read write only LSE = -inf, so S can stay fixed (a CUDA graph replays it) as L grows.
`_lookahead_attn_merge` folds the S + 1 partials of each row and writes the output. No mask tensor exists.

Compile-time: W, N, the GQA group, head dim, tile sizes, dtype (through the pointers and DOT_PRECISION) and the
TREE flag. The step length T (so the candidates present, or the tree size) and the split count are run-time; the row
tile is chosen from T x group by the launcher (`launch_config`), so T changes the compiled kernel only across the
tile sizes 16, 32, 64, 128.
Batch/head/position offsets are formed in 64 bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chain_end(k_idx, W: tl.constexpr, N: tl.constexpr):
    """Chains form: one past the last step index of k_idx's candidate. Mirrors `StepPattern.subtree_end`."""
    LA: tl.constexpr = W * (N - 1)
    return LA + ((k_idx - LA) // (N - 1) + 1) * (N - 1)


@triton.jit
def _visible(q_idx, k_idx, k_end, W: tl.constexpr, N: tl.constexpr):
    """Bool tile: step token q_idx attends to step token k_idx, whose subtree ends at k_end. Mirrors
    `pattern._visible_rule`."""
    LA: tl.constexpr = W * (N - 1)
    q_la = q_idx < LA
    k_la = k_idx < LA
    q_level = q_idx // W
    q_col = q_idx % W
    k_level = k_idx // W
    k_col = k_idx % W
    # lookahead: level 0 columns up to the query's, and the query's own column up to its level
    lookahead = q_la & k_la & (((k_level == 0) & (k_col <= q_col)) | ((k_col == q_col) & (k_level <= q_level)))
    # verification: the input token, and the nodes whose subtree holds the query (ancestors and itself)
    verify = (q_idx >= LA) & ((k_idx == 0) | ((k_idx >= LA) & (k_idx <= q_idx) & (q_idx < k_end)))
    return lookahead | verify


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
def _load(ptrs, mask, EVEN: tl.constexpr):
    """Load with `mask`, or with none when the block is known to be in bounds (EVEN)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["T"])
def _lookahead_attn_split(
    Q, K, V, PrefixLen, TreeEnd, PartialOut, PartialLse,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_tree_b, T, qk_scale, H_KV,
    W: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    LA: tl.constexpr = W * (N - 1)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2) - 1  # the last split is the step's own keys
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    prefix_len = tl.load(PrefixLen + b).to(tl.int32)
    rows = T * GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = offs_m // GROUP  # [BLOCK_M] step index of each row
    q_head = offs_m % GROUP  # [BLOCK_M] query head of each row, within the KV head's group
    row_ok = offs_m < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    # this split's share of the prefix, whole blocks: [lo, hi); the step split reads none of it
    n_blocks = tl.cdiv(prefix_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    lo = tl.minimum(split * per_split * BLOCK_N, prefix_len)
    hi = tl.minimum(lo + per_split * BLOCK_N, prefix_len)
    is_step = split == num_splits
    lo = tl.where(is_step, 0, lo)
    hi = tl.where(is_step, 0, hi)
    rows_read = tl.where(is_step | (lo < hi), rows, 0)  # an empty split reads no q either

    q_base = Q + b * stride_qb + (h_kv * GROUP) * stride_qh
    q_ptrs = q_base + q_head[:, None] * stride_qh + q_idx[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m < rows_read)[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    k_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt  # [BLOCK_D, BLOCK_N]
    v_offs = offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # cache prefix, full blocks: every step token sees all of it, so no masking work
    full_hi = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    k_ptrs = k_base + lo.to(tl.int64) * stride_kt + k_offs  # [BLOCK_D, BLOCK_N], advanced in 64 bits
    v_ptrs = v_base + lo.to(tl.int64) * stride_vt + v_offs  # [BLOCK_N, BLOCK_D]
    for _ in range(lo, full_hi, BLOCK_N):
        k = _load(k_ptrs, d_ok[:, None], EVEN_D)
        v = _load(v_ptrs, d_ok[None, :], EVEN_D)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt

    # cache prefix, the tail block when the row's prefix_len is not a multiple of BLOCK_N
    if full_hi < hi:
        n_ok = full_hi + offs_n < hi
        k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # the step's own keys (step split only). A key block is skipped when no row of the tile can see any of it, by
    # the intervals rows read: lookahead rows keys <= min(last token, LA - 1); verification rows key 0 and keys
    # from the first of their candidates (a tree: of the branch, LA) up to themselves. Scalars only: a tile-wide
    # reduction of the visibility tile here costs registers that spill at 128 x 64 tiles.
    first_tok = (pid_m * BLOCK_M) // GROUP
    last_tok = (tl.minimum((pid_m + 1) * BLOCK_M, rows) - 1) // GROUP
    la_hi = tl.where(first_tok < LA, tl.minimum(last_tok, LA - 1) + 1, 0)  # lookahead rows read keys < la_hi
    if TREE:
        verify_lo = LA
    else:
        verify_lo = LA + ((tl.maximum(first_tok, LA) - LA) // (N - 1)) * (N - 1)
    verify_lo = tl.where(last_tok >= LA, verify_lo, T + BLOCK_N)  # no verification rows: no verification keys
    step_hi = tl.where(is_step, last_tok + 1, 0)
    k_step = k_base + prefix_len.to(tl.int64) * stride_kt
    v_step = v_base + prefix_len.to(tl.int64) * stride_vt
    for start_n in range(0, step_hi, BLOCK_N):
        if (start_n < la_hi) | ((start_n == 0) & (last_tok >= LA)) | (start_n + BLOCK_N > verify_lo):
            k_idx = start_n + offs_n  # [BLOCK_N] step index of each key
            n_ok = k_idx < T
            k = tl.load(k_step + start_n * stride_kt + k_offs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_step + start_n * stride_vt + v_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if TREE:
                tree_end = tl.load(TreeEnd + b * stride_tree_b + (k_idx - LA), mask=n_ok & (k_idx >= LA), other=0)
                k_end = LA + tree_end
            else:
                k_end = _chain_end(k_idx, W, N)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            vis = _visible(q_idx[:, None], k_idx[None, :], k_end[None, :], W, N) & row_ok[:, None] & n_ok[None, :]
            qk = tl.where(vis, qk, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # partials [B * Hkv, S + 1, rows, HEAD_DIM] and [B * Hkv, S + 1, rows]; an empty split writes only LSE = -inf
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part_row = (pid_bh.to(tl.int64) * (num_splits + 1) + split) * rows + offs_m  # [BLOCK_M]
    tl.store(PartialLse + part_row, lse, mask=row_ok)
    o_ptrs = PartialOut + part_row[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, o, mask=(row_ok & seen)[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _lookahead_attn_merge(
    PartialOut, PartialLse, Out,
    stride_ob, stride_oh, stride_ot, stride_od,
    T, H_KV, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Out rows = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over the S + 1 splits of each row."""
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    rows = T * GROUP
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = pid_bh.to(tl.int64) * (num_splits + 1) * rows + offs_r  # [BLOCK_R] row of split 0

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits + 1):
        m = tl.maximum(m, tl.load(PartialLse + base + s * rows, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, num_splits + 1):
        lse = tl.load(PartialLse + base + s * rows, mask=row_ok, other=float("-inf"))
        seen = lse > float("-inf")
        w = tl.where(seen, tl.math.exp2(lse - m), 0.0)
        # empty splits wrote no partial output: never read it
        o = tl.load(PartialOut + (base + s * rows)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(row_ok & seen)[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
        acc += w[:, None] * o
        den += w
    out = acc / tl.where(den > 0, den, 1.0)[:, None]

    q_idx = offs_r // GROUP
    q_head = h_kv * GROUP + offs_r % GROUP
    o_ptrs = Out + b * stride_ob + q_head[:, None] * stride_oh + q_idx[:, None] * stride_ot
    tl.store(o_ptrs + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return not isinstance(_chain_end, triton.runtime.JITFunction)
