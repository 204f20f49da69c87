"""Launching the lookahead attention kernels of `attention_kernels.py`: `PagedAttentionPlan` (packed steps over a paged
KV cache, the one launch path; the classic dense contract on top of it is `dense_attention.py`'s), its tiling, and the
input checks both public entries share.

A plan fixes the tiles and the compile-time arguments once; calling it only allocates the output and the partials and
launches two kernels: no validation, no host read of a device value, nothing recompiled after the first call whatever
the rows' T, L, W, N, trees and tables, so it can run inside a CUDA graph. The split count of the prefix is chosen per
call from the call's rows and tokens (tensor shapes, known on the host: a graph captures one), so a short step or a
lone row over a long cache keeps the SMs busy. The kernels are looked up through this module's globals at each launch
and every compile-time argument is passed by keyword, so a test can wrap a global and record the constexprs used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from .attention_kernels import _lookahead_attn_merge, _lookahead_attn_split, interpreting
from .device import device_binding
from .pattern import StepPattern

__all__ = ["PagedAttentionPlan", "Rows", "TilePlan", "interpreting", "launch_config", "num_splits_for", "tile_plan"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_NOMINAL_SMS = 132  # an H100 SXM; the split count on a machine with no GPU (the interpreter) follows it
_MIN_BLOCKS_PER_SPLIT = 4  # each split streams at least this many K/V blocks at max_len
_MAX_SPLITS = 64
_MERGE_ROWS = 16
_LOG2E = 1.4426950408889634


def launch_config(tokens: int, group: int, head_dim: int, dtype: torch.dtype,
                  capability: tuple[int, int] | None = None) -> dict:
    """Tiles, padded head dim, dot precision, warps and stages of the split kernel for rows of at most `tokens` step
    tokens.

    Chosen from sm_90/sm_80 compilations without a GPU (tests/compile_for_gpu.py: registers, spills, shared
    memory), not from timings. BLOCK_M tiles the (step token, query head) rows of one KV head of one row, T x group:
    it covers all of them up to 128 (64 for D > 128), so each program reads its K/V blocks once for the whole step
    where that fits (every query tile re-reads the K/V: `tile_plan` counts the passes). A static generation has one T,
    so one compiled kernel; exact-size steps meet at most four tile sizes (16, 32, 64, 128). fp32 runs its dots as
    tf32x3 (three TF32 products, ~fp32 accuracy) instead of IEEE FMA code; its operand splitting needs registers, so
    it takes the smallest tiles (the fewest spills measured).
    """
    if dtype == torch.float32:
        block_m, block_n = 16, 16
    else:
        rows = tokens * group  # a row's step, lookahead and verification branches together
        block_m = min(128 if head_dim <= 128 else 64, max(16, triton.next_power_of_2(rows)))
        block_n = 64 if head_dim <= 128 else 32
    hopper = capability is None or capability[0] >= 9
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",  # tf32 is ignored by 16-bit dots
        "num_warps": 8 if block_m >= 128 else 4,
        # 16-bit D <= 128: three 32 KB K/V stages fit Hopper's 227 KB; two elsewhere
        "num_stages": 3 if dtype != torch.float32 and head_dim <= 128 and hopper else 2,
    }


def num_splits_for(programs_per_split: int, rows: int, max_len: int, block_n: int, sm_count: int) -> int:
    """Splits S of the cache prefix: enough programs for about one wave of the SMs, but each split keeps a few
    K/V blocks at max_len and the fp32 partials written (rows x D per split) stay under half the K/V read."""
    by_grid = max(1, sm_count // max(1, programs_per_split))
    by_blocks = max(1, triton.cdiv(max_len, block_n) // _MIN_BLOCKS_PER_SPLIT)
    by_traffic = max(1, max_len // (2 * max(1, rows)))
    return min(by_grid, by_blocks, by_traffic, _MAX_SPLITS)


@dataclass(frozen=True)
class TilePlan:
    """How one step's attention is tiled for one KV head of one sequence."""

    rows: int  # (step token, query head) rows: T x GQA group
    rows_per_tile: int  # BLOCK_M
    kv_passes: int  # query tiles: how many times every K/V block of the cache is read per step
    splits: int  # splits of the cache prefix (flash-decoding), plus one program for the step's own keys


def tile_plan(pattern: StepPattern, *, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, max_len: int,
              batch: int = 1, sm_count: int = _NOMINAL_SMS, capability: tuple[int, int] | None = None) -> TilePlan:
    """The tiling a `StepAttentionPlan` of these shapes launches (on a GPU with `sm_count` SMs); a
    `PagedAttentionPlan` tiles rows of max_row_tokens tokens the same way."""
    group = heads_q // heads_kv
    rows = pattern.num_tokens * group
    config = launch_config(pattern.num_tokens, group, head_dim, dtype, capability)
    passes = triton.cdiv(rows, config["BLOCK_M"])
    splits = num_splits_for(passes * batch * heads_kv, rows, max_len, config["BLOCK_N"], sm_count)
    return TilePlan(rows, config["BLOCK_M"], passes, splits)


class Rows(NamedTuple):
    """The rows of a packed step as the kernel reads them, integer tensors on the device (`paged_attention`'s
    arguments of the same names): block_table [B, max_blocks], cu_seqlens [B + 1], prefix_len, window, ngram [B],
    tree_end [ΣT]."""

    block_table: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_len: torch.Tensor
    window: torch.Tensor
    ngram: torch.Tensor
    tree_end: torch.Tensor


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


class PagedAttentionPlan:
    """Launches of the attention of packed steps over a paged KV cache, for fixed model shapes: checked once, then
    called per layer with device tensors and no checks.

    Fixed at construction: heads_q, heads_kv, head_dim, dtype, device, the scale, and from max_rows (B), max_row_tokens
    (the most step tokens of one row, T_b) and max_len (the most prefix positions of one row, L_b) the row tile
    (`launch_config`). Each call brings its own number of rows and tokens (tensor shapes, read on the host: a CUDA
    graph captures one), from which it takes its split count of the prefix (`splits`: `num_splits` if given, else
    `num_splits_for` the call's grid, bounded by max_len), and its own T_b, L_b, W_b, N_b, trees, block tables and
    block size (values on the device, or the pool's shape): none recompiles the kernels. Calls must keep T_b <=
    max_row_tokens (the grid covers that many query tiles per row; longer rows would be cut, unchecked).
    `num_splits` is the split count of a call of the largest shape (max_rows rows of max_row_tokens tokens).
    """

    def __init__(self, *, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 max_rows: int, max_row_tokens: int, max_len: int, sm_scale: float | None = None,
                 num_splits: int | None = None) -> None:
        for name, value, low in (("heads_q", heads_q, 1), ("heads_kv", heads_kv, 1), ("head_dim", head_dim, 1),
                                 ("max_rows", max_rows, 1), ("max_row_tokens", max_row_tokens, 1),
                                 ("max_len", max_len, 0)):
            _check_int(name, value, low)
        if heads_q % heads_kv:
            raise ValueError(f"query heads ({heads_q}) must be a multiple of KV heads ({heads_kv})")
        if head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"head dim {head_dim} is larger than the kernel's maximum {_MAX_HEAD_DIM}")
        _check_dtype(dtype)
        _check_sm_scale(sm_scale)
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or not 1 <= num_splits <= 65535):
            raise ValueError(f"num_splits must be an int in [1, 65535] or None, got {num_splits!r}")
        if max_rows * heads_kv > 65535:
            raise ValueError(f"rows x KV heads = {max_rows} x {heads_kv} exceeds the grid's 65535")
        device = torch.device(device)
        self.heads_q, self.heads_kv, self.head_dim, self.dtype, self.device = heads_q, heads_kv, head_dim, dtype, device
        self.max_rows, self.max_row_tokens, self.max_len = max_rows, max_row_tokens, max_len
        self.group = heads_q // heads_kv
        self.qk_scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * _LOG2E
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        config = launch_config(max_row_tokens, self.group, head_dim, dtype, capability)
        self.options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
        self.constexprs = dict(GROUP=self.group, HEAD_DIM=head_dim, **config)
        self.row_tiles = triton.cdiv(max_row_tokens * self.group, config["BLOCK_M"])
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        self.sm_count = sms or _NOMINAL_SMS
        self.fixed_splits = num_splits
        self._splits: dict[tuple[int, int], int] = {}
        self.num_splits = self.splits(max_rows, max_rows * max_row_tokens)
        self.merge_constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=config["BLOCK_D"], BLOCK_R=_MERGE_ROWS)

    def splits(self, rows: int, tokens: int) -> int:
        """S, the prefix splits of a call of `rows` rows (padding rows included) and `tokens` tokens in all: enough
        programs for about one wave of the SMs given the call's own row tiles and rows, so a short step (few row
        tiles, few partials per split) or a lone row over a long cache splits the cache more than the plan's largest
        call would; at most what max_len allows (`num_splits_for`). Fixed if the plan was given `num_splits`."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        key = (rows, tokens)
        if key not in self._splits:
            block_m = self.constexprs["BLOCK_M"]
            row_tiles = min(self.row_tiles, triton.cdiv(tokens * self.group, block_m))
            per_row = triton.cdiv(tokens, max(rows, 1)) * self.group
            self._splits[key] = num_splits_for(max(1, row_tiles) * max(rows, 1) * self.heads_kv, per_row,
                                               self.max_len, self.constexprs["BLOCK_N"], self.sm_count)
        return self._splits[key]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 cu_seqlens: torch.Tensor, prefix_len: torch.Tensor, window: torch.Tensor, ngram: torch.Tensor,
                 tree_end: torch.Tensor) -> torch.Tensor:
        """q [ΣT, Hq, D] any strides; k_cache, v_cache [num_blocks, Hkv, block_size, D] any strides; block_table
        [B, max_blocks]; cu_seqlens [B + 1]; prefix_len, window, ngram [B] contiguous; tree_end [ΣT] aligned with q;
        all integer tensors on the device (int32 or int64), as `paged_attention` documents them (unchecked here).
        Returns [ΣT, Hq, D] contiguous in q's dtype; tokens past cu_seqlens[B] (padding of no row) get zeros."""
        stride = tree_end.stride(0)
        rows = Rows(block_table, cu_seqlens, prefix_len, window, ngram, tree_end)
        return self._launch(q, k_cache, v_cache, rows, (0, stride, stride))

    def _launch(self, q, k, v, rows: Rows, tree_strides: tuple[int, int, int]) -> torch.Tensor:
        """tree_strides: node j of row b's tree is at b * [0] + (cu_b + LA_b) * [1] + j * [2] (so a dense [B, V] or
        [V] tree is read in place)."""
        tokens, batch = q.shape[0], rows.block_table.shape[0]
        splits = self.splits(batch, tokens)
        out = torch.empty(tokens, self.heads_q, self.head_dim, dtype=q.dtype, device=q.device)
        parts = (splits + 1) * tokens * self.heads_q
        partial_out = torch.empty(parts, self.head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
        row_tiles = min(self.row_tiles, triton.cdiv(tokens * self.group, self.constexprs["BLOCK_M"]))
        with device_binding(self.device):  # Triton launches on the current device and stream: make them the plan's
            if row_tiles and batch:
                _lookahead_attn_split[(row_tiles, batch * self.heads_kv, splits + 1)](
                    q, k, v, *rows, partial_out, partial_lse,
                    *q.stride(), *k.stride(), *v.stride(), *rows.block_table.stride(), *tree_strides,
                    k.shape[2], tokens, self.qk_scale, self.heads_kv,
                    **self.constexprs, **self.options,
                )  # fmt: skip
            if tokens:
                _lookahead_attn_merge[(triton.cdiv(tokens * self.heads_q, _MERGE_ROWS),)](
                    partial_out, partial_lse, out, rows.cu_seqlens, *out.stride(), tokens, batch, self.heads_q,
                    splits, **self.merge_constexprs, num_warps=4, num_stages=1,
                )  # fmt: skip
        return out


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; use one of float16, bfloat16, float32")
    if dtype == torch.bfloat16 and interpreting():
        raise ValueError("bfloat16 under the Triton interpreter: it computes bf16 dots wrongly "
                         "(triton-lang/triton#11584); use float16 or float32 here, or run on a GPU")


def _check_sm_scale(sm_scale) -> None:
    ok = isinstance(sm_scale, (int, float)) and not isinstance(sm_scale, bool) and math.isfinite(sm_scale)
    if sm_scale is not None and not (ok and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite positive number or None, got {sm_scale!r}")


def _check_are_tensors(named: dict[str, object]) -> None:
    """Each of `named` a torch.Tensor: an entry's first check, before any of their attributes is read."""
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_integer_tensor(name: str, x: torch.Tensor, device: torch.device, shapes: Sequence[tuple]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")


def _check_runnable(device: torch.device, name: str, reference: str) -> None:
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name} got CPU tensors, but Triton runs on CPU only in its interpreter "
                         f"(set TRITON_INTERPRET=1 before importing triton); on CPU use {reference} "
                         "(the model's attn_backend='torch')")
