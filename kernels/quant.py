"""GGUF-quantized weights kept quantized: packed once for the CPU kernel (`csrc/quant_gemm.cpp`), multiplied with the
batch-invariant contract (a row's bits depend on its own input alone), and the same arithmetic in numpy
(`reference_gemm`), which the tests hold the kernel to bitwise.

Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32), Q4_K and Q6_K (super-blocks of 256): what llama.cpp's Q8_0,
Q4_0, Q4_1 and Q4_K_M files hold (a Q4_K_M file falls back to Q5_0 and Q8_0 where a row's length is no multiple of
256). Each input row is quantized to 8 bits in blocks of 32 (as llama.cpp does for its dot products) and multiplied
with integer dot products (AVX512-VNNI where the CPU has it, else AVX2, else portable loops: the same arithmetic);
`csrc/quant_gemm.cpp`'s header comment gives it exactly. The packed layout keeps the file's bits per weight (within a
few percent: a Q4_K sub-block's 6-bit scale takes a byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_kernels

MAGIC = 0x4C4B485131
COLS = 16  # outputs per column group
BLOCK = 32  # inputs per block
HEADER = 16  # int64 fields


@dataclass(frozen=True)
class Layout:
    """How a ggml type maps onto the packed form: high bits beyond the low nibble (8: whole bytes instead of planes),
    the zero point (-1: a "min" type),
    blocks of 32 per scale, sub-scales per block (0: none), and the bytes of one ggml block of `weights` weights."""

    name: str
    ggml_id: int
    hb: int
    zero: int
    per: int
    subs: int
    block_bytes: int
    weights: int


LAYOUTS = {layout.name: layout for layout in (
    Layout("Q4_0", 2, 0, 8, 1, 0, 18, 32),
    Layout("Q4_1", 3, 0, -1, 1, 0, 20, 32),
    Layout("Q5_0", 6, 1, 16, 1, 0, 22, 32),
    Layout("Q5_1", 7, 1, -1, 1, 0, 24, 32),
    Layout("Q8_0", 8, 8, 128, 1, 0, 34, 32),  # hb 8: whole bytes, nothing to unpack
    Layout("Q4_K", 12, 0, -1, 8, 1, 144, 256),
    Layout("Q6_K", 14, 2, 32, 8, 2, 210, 256),
)}
TYPES = tuple(LAYOUTS)


@dataclass
class Fields:
    """A weight [N, K] decoded from its ggml blocks: codes [N, K] uint8 (unsigned), d [N, K / 32 / per] float16, and
    as the type has them m (float16, like d: a min type's min, stored so that w = d * s * c - m * t), sc [N, K / 32,
    subs] and mn [N, K / 32] (a K-quant's sub-block scales and mins)."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight nibble order: byte i holds weight i (low) and weight i + 16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 8 six-bit scales and mins from its 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode(raw: np.ndarray, type_name: str, n: int, k: int) -> Fields:
    """The fields of a ggml tensor [n, k] of `type_name` from its raw bytes (any shape holding n * blocks * bytes)."""
    layout = LAYOUTS[type_name]
    if k % layout.weights:
        raise ValueError(f"a {type_name} row holds a multiple of {layout.weights} weights, got {k}")
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // layout.weights, layout.block_bytes)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b, 0)
        if type_name == "Q8_0":
            return Fields((b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k), d)
        m = -_f16(b, 2) if type_name in ("Q4_1", "Q5_1") else None  # stored negated: w = d * c - m
        at = 4 if m is not None else 2
        codes = _nibbles(b[..., at + 4 * layout.hb:])
        if layout.hb:
            qh = np.ascontiguousarray(b[..., at:at + 4]).view("<u4")
            codes = codes | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return Fields(codes.reshape(n, k), d, m)
    if type_name == "Q4_K":
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # four chunks of 64 weights: low nibbles, then high nibbles
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)
        return Fields(codes, d, dmin, sc.reshape(n, -1, 1), mn.reshape(n, -1))
    if type_name == "Q6_K":
        ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        scales = b[..., 192:208].view(np.int8)
        d = _f16(b, 208)
        # per half of 128: weights l, l + 32, l + 64, l + 96 from ql[l], ql[l + 32] (low, then high nibbles) and
        # qh[l]'s 2-bit fields 0, 1, 2, 3
        low = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
        codes = (low | (high << 4)).reshape(n, k)
        return Fields(codes, d, None, scales.reshape(n, -1, 2))
    raise ValueError(f"no decoder for {type_name}")


def pack(fields: Fields, type_name: str) -> torch.Tensor:
    """The packed blob (uint8 [bytes]) `csrc/quant_gemm.cpp` reads: a header, then codes, d, m, sc, mn by column
    groups of 16 outputs (the last padded with zero codes and scales)."""
    layout = LAYOUTS[type_name]
    n, k = fields.codes.shape
    groups, blocks = -(-n // COLS), k // BLOCK
    pad = groups * COLS - n

    def by_group(a: np.ndarray) -> np.ndarray:  # [n, ...] -> [groups, ..., 16]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(groups, COLS, *a.shape[1:])
        return np.ascontiguousarray(np.moveaxis(a, 1, -1))

    codes = by_group(fields.codes.reshape(n, blocks, 8, 4))  # [g, j, t, b, c]
    codes = np.ascontiguousarray(codes.transpose(0, 1, 2, 4, 3))  # [g, j, t, c, b]: 64 bytes a quad
    low, high = codes & 15, codes >> 4
    planes = [codes] if layout.hb == 8 else [low[:, :, :4] | (low[:, :, 4:] << 4)]
    if 0 < layout.hb < 8:
        hi = np.zeros((groups, blocks, layout.hb, COLS, 4), np.uint8)
        for t in range(8):
            bit = layout.hb * t
            hi[:, :, bit // 8] |= (high[:, :, t] << (bit % 8)).astype(np.uint8)
        planes.append(hi)
    regions = [np.concatenate([p.reshape(groups, blocks, -1) for p in planes], axis=-1),
               by_group(fields.d.astype(np.float16)).view(np.uint8)]
    regions.append(None if fields.m is None else by_group(fields.m.astype(np.float16)).view(np.uint8))
    regions.append(None if fields.sc is None else by_group(fields.sc).view(np.uint8))
    regions.append(None if fields.mn is None else by_group(fields.mn).view(np.uint8))
    offsets, at = [], HEADER * 8
    for region in regions:
        offsets.append(at if region is not None else 0)
        at += 0 if region is None else -(-region.nbytes // 64) * 64
    header = np.array([MAGIC, layout.ggml_id, n, k, groups, blocks, layout.hb, layout.zero, layout.per, layout.subs,
                       *offsets, at], np.int64)
    blob = np.zeros(at, np.uint8)
    blob[:HEADER * 8] = header.view(np.uint8)
    for offset, region in zip(offsets, regions, strict=True):
        if region is not None:
            blob[offset:offset + region.nbytes] = np.ascontiguousarray(region).reshape(-1).view(np.uint8)
    return torch.from_numpy(blob)


def pack_ggml(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    """A ggml tensor [n, k] (its raw bytes, as a GGUF file holds them) packed for `gemm`."""
    return pack(decode(raw, type_name, n, k), type_name)


@dataclass(frozen=True)
class Header:
    """A packed blob's header, read back."""

    type_name: str
    out_features: int
    in_features: int


def header(blob: torch.Tensor) -> Header:
    h = blob[:HEADER * 8].numpy().view(np.int64)
    if h[0] != MAGIC:
        raise ValueError("not a packed quantized weight")
    name = next(name for name, layout in LAYOUTS.items() if layout.ggml_id == h[1])
    return Header(name, int(h[2]), int(h[3]))


def gemm(x: torch.Tensor, blobs: list[torch.Tensor], portable: bool = False) -> torch.Tensor:
    """x [M, K] (converted to float32) times the packed weights side by side: [M, sum of their N] float32, each
    row's bits its own (`csrc/quant_gemm.cpp`). portable: the portable loops even where a vector path is built
    (AVX512-VNNI or AVX2: the same bits; the tests compare). Call `cpu_kernels.available` first."""
    return cpu_kernels.extension().quant_gemm(x.float().contiguous(), list(blobs), portable)


def rows(blob: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight, dequantized to float32 as ggml (and gguf's `dequantize`) does: [*ids.shape, K].
    Call `cpu_kernels.available` first."""
    flat = cpu_kernels.extension().quant_rows(blob, ids.reshape(-1))
    return flat.reshape(*ids.shape, flat.shape[-1])


def path() -> str | None:
    """How this machine's build multiplies: "AVX512-VNNI", "AVX2" or "portable" (None: the kernels are not built).
    Call `available` first."""
    return None if cpu_kernels.extension() is None else cpu_kernels.extension().quant_path()


def dequantize(fields: Fields, type_name: str) -> np.ndarray:
    """The weight [N, K] in float32, as ggml dequantizes it (each weight's formula, rounded as ggml rounds it)."""
    layout = LAYOUTS[type_name]
    n, k = fields.codes.shape
    c = fields.codes.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    d = np.repeat(fields.d.astype(np.float32), layout.per, axis=1)[..., None]
    if layout.zero >= 0:
        if fields.sc is not None:  # Q6_K: (d * sc) * (c - 32), sc per 16
            d = d * np.repeat(fields.sc.astype(np.float32), 16, axis=-1)
        w = d * (c - np.float32(layout.zero))
    elif fields.sc is not None:  # Q4_K: (d * sc) * c - dmin * mn
        dmin = np.repeat(fields.m.astype(np.float32), layout.per, axis=1)[..., None]
        w = (d * fields.sc.astype(np.float32)) * c - dmin * fields.mn.astype(np.float32)[..., None]
    else:
        w = d * c - fields.m.astype(np.float32)[..., None]
    return w.reshape(n, k).astype(np.float32)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 as the kernel quantizes it: q [M, K / 32, 32] int32 and dx [M, K / 32] float32."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int32)
    return q, d


def reference_gemm(x: np.ndarray, fields: Fields, type_name: str) -> np.ndarray:
    """The kernel's arithmetic in numpy (float32 products and sums rounded one at a time, in the kernel's order):
    x [M, K] times the weight, [M, N] float32."""
    layout = LAYOUTS[type_name]
    q, dx = quantize_rows(x)
    n, k = fields.codes.shape
    blocks = k // BLOCK
    codes = fields.codes.reshape(n, blocks, BLOCK).astype(np.int64)
    dots = np.einsum("mjk,njk->mnj", q.astype(np.int64), codes)  # exact
    halves = np.einsum("mjhk,njhk->mnjh", q.reshape(*q.shape[:2], 2, 16).astype(np.int64),
                       codes.reshape(n, blocks, 2, 16))
    sums = q.reshape(*q.shape[:2], 2, 16).sum(-1).astype(np.int64)  # [m, j, 2]
    d = np.repeat(fields.d.astype(np.float32), layout.per, axis=1)  # [n, j]
    scale = (d[None] * dx[:, None]).astype(np.float32)  # [m, n, j]
    if layout.zero >= 0:
        if fields.sc is not None:
            sc = fields.sc.astype(np.int64)[None]  # [1, n, j, 2]
            i = (sc * (halves - layout.zero * sums[:, None])).sum(-1)
        else:
            i = dots - layout.zero * sums.sum(-1)[:, None]
        terms = [(scale, i, 1)]
    else:
        s = fields.sc[..., 0].astype(np.int64)[None] if fields.sc is not None else 1
        t = fields.mn.astype(np.int64)[None] if fields.mn is not None else 1
        m = np.repeat(fields.m.astype(np.float32), layout.per, axis=1)
        terms = [(scale, s * dots, 1), ((m[None] * dx[:, None]).astype(np.float32), t * sums.sum(-1)[:, None], -1)]
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(blocks):
        for factor, ints, sign in terms:
            product = (factor[..., j] * ints[..., j].astype(np.float32)).astype(np.float32)
            acc = (acc + product if sign > 0 else acc - product).astype(np.float32)
    return acc
