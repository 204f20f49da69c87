"""Triton kernels of the lookahead attention over packed (varlen) steps and a paged KV cache: split-K over each row's
cache prefix (flash-decoding), then a merge.

Every row b of a call has its own step: T_b tokens laid end to end with the other rows' (`q[cu_b : cu_b + T_b]`,
FlashAttention's cu_seqlens), its own window W_b, n-gram size N_b, tree and prefix length L_b, all read from memory.
Its keys live in a pool of fixed-size blocks: position p of row b is in physical block `table[b, p // block_size]` at
offset `p % block_size`; the step's own T_b keys were written at positions L_b .. L_b + T_b - 1 before the call. The
dense layout ([B, Hkv, S, D] per row) is the special case of one block of S positions per row.

`_lookahead_attn_split` runs over (query tiles, B x Hkv, S + 1). A program owns a block of query rows of one KV head of
one row; its rows are (step token, query head) pairs packed token-major, so the GQA heads that share a KV head ride in
one tile and each K/V tile is loaded once per group; a tile never spans two rows, and the tiles past a row's T_b x group
rows read and write nothing (a grid covers the longest row a plan allows). Splits 0..S-1 each take an even share of the
row's cache prefix with no mask work except the one tail block; split S takes the step's own keys under the integer rule
`_visible` (line for line `pattern._visible_rule`, W and N at run time) and skips key blocks that no row of the tile can
see. Each program writes an fp32 partial output and its log-sum-exp (log2 units); splits with nothing to read write only
LSE = -inf, so S can stay fixed (a CUDA graph replays it) as L grows. `_lookahead_attn_merge` folds the S + 1 partials
of each (token, head) and writes the output; tokens past cu_seqlens[B] (a graph bucket's padding) get zeros. No mask
tensor exists.

Compile-time: the GQA group, head dim, tile sizes and dtype (through the pointers and DOT_PRECISION). Everything of a
step (T_b, W_b, N_b, the tree, L_b, the tables, the split count, the number of rows and tokens) is run-time. Offsets
into K/V, the tables, the partials and the output are formed in 64 bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _visible(q_idx, k_idx, k_end, W, N):
    """Bool tile: step token q_idx attends to step token k_idx, whose subtree ends at k_end. Mirrors
    `pattern._visible_rule`; W and N may be run-time values or constexprs."""
    LA = W * (N - 1)
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
def _slots(Table, pos, ok, block_size, stride_tablen):
    """Where positions pos [BLOCK_N] of a row live: (physical block, offset in it), both int64. Masked positions
    read table entry 0 and give block 0, offset 0 (their loads are masked too)."""
    blk = tl.load(Table + (pos // block_size).to(tl.int64) * stride_tablen, mask=ok, other=0).to(tl.int64)
    return blk, (pos % block_size).to(tl.int64)


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """Load with `mask`, or with none when the block is known to be in bounds (EVEN)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["num_tokens"])
def _lookahead_attn_split(
    Q, K, V, BlockTable, CuSeqlens, PrefixLen, Window, Ngram, TreeEnd, PartialOut, PartialLse,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_tableb, stride_tablen,
    stride_treeb, stride_treet, stride_treej,
    block_size, num_tokens, qk_scale, H_KV,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Q [num_tokens, H_KV * GROUP, D]; K, V [blocks, H_KV, block_size, D]; BlockTable [B, max_blocks];
    CuSeqlens [B + 1]; PrefixLen, Window, Ngram [B] (contiguous); node j of row b's tree at
    TreeEnd + b * stride_treeb + (cu_b + LA_b) * stride_treet + j * stride_treej.
    PartialOut [S + 1, num_tokens, H_KV * GROUP, D] fp32, PartialLse [S + 1, num_tokens, H_KV * GROUP] fp32."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2) - 1  # the last split is the step's own keys
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    tok0 = tl.load(CuSeqlens + b).to(tl.int32)  # the row's first token in q
    T = tl.load(CuSeqlens + b + 1).to(tl.int32) - tok0
    rows = T * GROUP
    # a row shorter than the grid's longest (or idle) has no rows in this tile: it reads and writes nothing (empty
    # loops and masks; an early `return` here costs a stack frame on sm_90)
    tile_ok = pid_m * BLOCK_M < rows
    prefix_len = tl.load(PrefixLen + b).to(tl.int32)
    W = tl.load(Window + b).to(tl.int32)
    N = tl.load(Ngram + b).to(tl.int32)
    LA = W * (N - 1)
    table = BlockTable + b * stride_tableb

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
    lo = tl.where(is_step | ~tile_ok, 0, lo)
    hi = tl.where(is_step | ~tile_ok, 0, hi)
    rows_read = tl.where(is_step | (lo < hi), rows, 0)  # an empty split reads no q either

    q_tok = tok0.to(tl.int64) + q_idx  # [BLOCK_M] token of each row in q
    q_ptrs = Q + q_tok[:, None] * stride_qt + (h_kv * GROUP + q_head)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m < rows_read)[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_head = K + h_kv * stride_kh + offs_d[:, None] * stride_kd  # [BLOCK_D, 1]
    v_head = V + h_kv * stride_vh + offs_d[None, :] * stride_vd  # [1, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # cache prefix, full blocks: every step token sees all of it, so no masking work. The table entries of a tile are
    # read one tile ahead: K/V addresses then come from the loop-carried value, not from a load of the same
    # iteration, and the software pipeliner keeps num_stages - 1 K/V tiles in flight as on a dense cache (read in
    # the same iteration, sm_90 kept one in flight and waited for every copy each tile)
    full_hi = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    blk, off = _slots(table, lo + offs_n, lo + offs_n < full_hi, block_size, stride_tablen)  # [BLOCK_N] each
    for start_n in range(lo, full_hi, BLOCK_N):
        k = _load(k_head + (blk * stride_kb + off * stride_kt)[None, :], d_ok[:, None], EVEN_D)  # [BLOCK_D, BLOCK_N]
        v = _load(v_head + (blk * stride_vb + off * stride_vt)[:, None], d_ok[None, :], EVEN_D)  # [BLOCK_N, BLOCK_D]
        next_pos = start_n + BLOCK_N + offs_n
        blk, off = _slots(table, next_pos, next_pos < full_hi, block_size, stride_tablen)  # the next tile's, ahead
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # cache prefix, the tail block when the row's prefix_len is not a multiple of BLOCK_N
    if full_hi < hi:
        n_ok = full_hi + offs_n < hi
        blk, off = _slots(table, full_hi + offs_n, n_ok, block_size, stride_tablen)
        k = tl.load(k_head + (blk * stride_kb + off * stride_kt)[None, :], mask=d_ok[:, None] & n_ok[None, :],
                    other=0.0)
        v = tl.load(v_head + (blk * stride_vb + off * stride_vt)[:, None], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # the step's own keys (step split only). A key block is skipped when no row of the tile can see any of it, by
    # the intervals rows read: lookahead rows keys <= min(last token, LA - 1); verification rows key 0 and keys from
    # LA up to themselves. Scalars only: a tile-wide reduction of the visibility tile here costs registers.
    first_tok = (pid_m * BLOCK_M) // GROUP
    last_tok = (tl.minimum((pid_m + 1) * BLOCK_M, rows) - 1) // GROUP
    la_hi = tl.where(first_tok < LA, tl.minimum(last_tok, LA - 1) + 1, 0)  # lookahead rows read keys < la_hi
    verify_lo = tl.where(last_tok >= LA, LA, T + BLOCK_N)  # no verification rows: no verification keys
    step_hi = tl.where(is_step & tile_ok, last_tok + 1, 0)
    tree = TreeEnd + b * stride_treeb + (tok0 + LA).to(tl.int64) * stride_treet  # node 0 of the row's tree
    for start_n in range(0, step_hi, BLOCK_N):
        if (start_n < la_hi) | ((start_n == 0) & (last_tok >= LA)) | (start_n + BLOCK_N > verify_lo):
            k_idx = start_n + offs_n  # [BLOCK_N] step index of each key
            n_ok = k_idx < T
            blk, off = _slots(table, prefix_len + k_idx, n_ok, block_size, stride_tablen)
            k = tl.load(k_head + (blk * stride_kb + off * stride_kt)[None, :], mask=d_ok[:, None] & n_ok[None, :],
                        other=0.0)
            v = tl.load(v_head + (blk * stride_vb + off * stride_vt)[:, None], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            node = k_idx - LA
            k_end = LA + tl.load(tree + node.to(tl.int64) * stride_treej, mask=n_ok & (node >= 0), other=0)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            vis = _visible(q_idx[:, None], k_idx[None, :], k_end[None, :], W, N) & row_ok[:, None] & n_ok[None, :]
            qk = tl.where(vis, qk, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, qk, v, DOT_PRECISION)

    # partials: an empty split writes only LSE = -inf
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part_row = (split.to(tl.int64) * num_tokens + q_tok) * (H_KV * GROUP) + h_kv * GROUP + q_head  # [BLOCK_M]
    tl.store(PartialLse + part_row, lse, mask=row_ok)
    o_ptrs = PartialOut + part_row[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, o, mask=(row_ok & seen)[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "num_splits"])
def _lookahead_attn_merge(
    PartialOut, PartialLse, Out, CuSeqlens,
    stride_ot, stride_oh, stride_od,
    num_tokens, num_rows, heads_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Out [num_tokens, heads_q, D] rows (token, head), flattened token-major: sum_s 2^(lse_s - m) o_s /
    sum_s 2^(lse_s - m) over the S + 1 splits; tokens past CuSeqlens[num_rows] (padding of no row) get zeros."""
    pid_r = tl.program_id(0)
    offs_r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] flat (token, head) rows
    total = tl.load(CuSeqlens + num_rows).to(tl.int64) * heads_q  # rows some step owns
    split_rows = num_tokens.to(tl.int64) * heads_q  # rows of one split's partials, and of the output
    out_ok = offs_r < split_rows
    row_ok = offs_r < total
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits + 1):
        m = tl.maximum(m, tl.load(PartialLse + s * split_rows + offs_r, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, num_splits + 1):
        lse = tl.load(PartialLse + s * split_rows + offs_r, mask=row_ok, other=float("-inf"))
        seen = lse > float("-inf")
        w = tl.where(seen, tl.math.exp2(lse - m), 0.0)
        # empty splits wrote no partial output: never read it
        o = tl.load(PartialOut + (s * split_rows + offs_r)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(row_ok & seen)[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
        acc += w[:, None] * o
        den += w
    out = acc / tl.where(den > 0, den, 1.0)[:, None]

    token = offs_r // heads_q
    head = offs_r % heads_q
    o_ptrs = Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_ok[:, None] & d_ok[None, :])


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return not isinstance(_visible, triton.runtime.JITFunction)
