"""A batch-invariant GEMM for the CPU, compiled at first use: every output a chain of fused multiply-adds over K in
order, from zero, whatever the number of rows, their place among them and the threads.

`pack(weight)` lays a weight [N, K] out once as [ceil(N / 64), K, 64] (column blocks; float32, or bfloat16 kept in
16 bits and widened in registers: half the bytes a token reads); `gemm(x, packed)` computes x [M, K] (float32) times
it, [M, N] float32. Threads split the column blocks; each block's rows go six at a time through one tile routine
whose arithmetic per output is the same for one row or six, so a row's bits depend on nothing but its own inputs (no
split of K, no kernel chosen by shape). A block's bytes are read once per six rows (six rows' accumulators and a row
of the block fill an AVX-512 register file): a one-token step reads the weight once, like a GEMV, and a longer step
reads it again from cache. `attention(...)`, in the same extension, is the batch-invariant attention on the CPU (each
query over its own keys in position order: `block_attention`'s contract as fused multiply-add chains), and
`decoder_step(...)` runs one packed step of a LLaMA model from its token ids to its logits in one call (the ops of the
Python layers as the mode runs them, with these kernels, so the same bits, and no ATen op between them); `silu_mul`
is the mode's SiLU(gate) * up.

The source (`csrc/cpu_kernels_module.cpp`: `csrc/cpu_kernels.cpp`, the GEMM, norms and RoPE;
`csrc/chain_attention.cpp`, the attention; `csrc/quant_gemm.cpp`, GEMMs over GGUF-quantized weights driven by
`lookahead.kernels.quant`; `csrc/decoder_step.cpp`, the step in one call and the SiLU; and their bindings) is
compiled as one extension by `lookahead.cpp_build` (a C++ compiler and ninja) into `build_dir`, once per kind of CPU,
compiler and version of the source; where that fails `available`
is False (`failure` says why) and callers use `row_plans` instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

import lookahead.cpp_build as cpp_build

COLUMNS = 64  # columns per block: four AVX-512 vectors of float32 per row
CSRC = Path(__file__).parent / "csrc"
# one translation unit, in this order (the later ones use the first's thread pool)
SOURCE_FILES = ("cpu_kernels.cpp", "chain_attention.cpp", "quant_gemm.cpp", "decoder_step.cpp")
# (GCC 12 warns of `__Y` "maybe uninitialized" inside its own AVX-512 intrinsics, hundreds of times: GCC bug 105593)
WARNINGS = ("-Wall", "-Wextra", "-Wno-maybe-uninitialized")
_built = cpp_build.Once("The batch-invariant mode runs torch's GEMMs through verified row counts instead (slower), "
                        "and on a CPU with bf16 dot products a model loads in float32, not bfloat16")


@dataclass(frozen=True)
class Packed:
    """A weight [N, K] as column blocks [ceil(N / 64), K, 64] (float32, or bfloat16 bits as int16; bf16 pairs:
    [ceil(N / 64), ceil(K / 2), 64, 2])."""

    blocks: torch.Tensor
    out_features: int
    in_features: int

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (any shape of int64 indices), exactly its values: [*ids.shape, K], float32 or
        bfloat16 as packed. What a tied embedding reads where its weight lives only here
        (`Llama.keep_weights_once`)."""
        block, column = ids // COLUMNS, ids % COLUMNS
        if self.blocks.dim() == 4:  # pairs of k
            return self.blocks[block, :, column, :].flatten(-2)[..., : self.in_features].view(torch.bfloat16)
        rows = self.blocks[block, :, column]
        return rows.view(torch.bfloat16) if rows.dtype == torch.int16 else rows


def pack(weight: torch.Tensor, widen: bool = False) -> Packed:
    """Lay a CPU weight [N, K] out for `gemm`: bfloat16 stays 16-bit (in pairs of k where the build has bf16 dot
    products, `pairs`, unless `widen`: the widening path's layout, for a comparison), every other dtype becomes
    float32. Call `available` first."""
    n, k = weight.shape
    w = weight.detach()
    w = w if w.dtype == torch.bfloat16 else w.float()
    pad = -n % COLUMNS
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    if w.dtype == torch.bfloat16 and pairs() and not widen:
        w = torch.cat([w, w.new_zeros(w.shape[0], 1)], dim=1) if k % 2 else w  # an odd K's last pair: a zero weight
        blocks = w.view(-1, COLUMNS, w.shape[1] // 2, 2).transpose(1, 2).contiguous()
        return Packed(blocks.view(torch.int16), n, k)
    blocks = w.view(-1, COLUMNS, k).transpose(1, 2).contiguous()
    return Packed(blocks.view(torch.int16) if blocks.dtype == torch.bfloat16 else blocks, n, k)


def give_back_freed() -> None:
    """Return freed memory to the system (glibc keeps small freed blocks resident in its heap): after weights were
    released (`Llama.keep_weights_once`). Call `available` first."""
    _built.module.give_back_freed()


def stamps(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's identity, version counter and data address, int64 [len(tensors), 3], in one call: a kept copy
    of weights is stale once its row changes (reading them from Python costs about a microsecond a tensor). Call
    `available` first."""
    return _built.module.stamps(tensors)


def pairs() -> bool:
    """Whether this machine's build multiplies bfloat16 weights with the CPU's bf16 dot products (AVX512-BF16): then
    `gemm` takes bfloat16 rows for them, and each output is a chain over pairs of k (each pair's two products added
    by the instruction) instead of one over k. Call `available` first."""
    return _built.module is not None and _built.module.bf16_pairs()


def available(build_dir: str | os.PathLike | None = None) -> bool:
    """Whether the kernel is compiled (compiling it into `build_dir` on the first call; a failure warns once)."""
    return _load(build_dir) is not None


def gemm(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x [M, K] (contiguous, on the CPU) times the packed weight: [M, N] float32. x is float32, or bfloat16 for a
    bfloat16 weight packed in pairs (`pairs`); rows of another dtype are converted (to bfloat16 for pairs, so give a
    bfloat16 model's rows: float32 ones would be rounded). Call `available` first."""
    dtype = torch.bfloat16 if packed.blocks.dim() == 4 else torch.float32
    return _built.module.rows_gemm(x.to(dtype).contiguous(), packed.blocks, packed.out_features)


def attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, slots: torch.Tensor,
              counts: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Each query over its own keys (`invariant_triton.invariant_attention`'s contract, on the CPU): q [R, Hq, D];
    k_all, v_all [Hkv, S, D] (any float dtype; rows contiguous); slots [R, width], query i's key slots in position
    order in its first counts[i] entries. Each score a fused multiply-add chain over D, the max over them, then one
    chain over the keys in order for each output and for the weights' sum: a query's output depends on its own keys
    alone. Returns [R, Hq, D] in q's dtype. Call `available` first."""
    dim = q.shape[-1]
    q32 = (q.float() * (dim ** -0.5 if scale is None else scale)).contiguous()
    out = _built.module.chain_attention(q32, k_all.contiguous(), v_all.contiguous(), slots.to(torch.int64).contiguous(),
                                  counts.to(torch.int64).contiguous())
    return out.to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The batch-invariant mode's RMSNorm of x [..., H] (any float dtype; weight [H]): per row, the squares summed in
    float32 in 16 lanes, then x / rms rounded to x's dtype, times the weight; each row's bits its own, in one call
    (`decoder_step` runs the same). Call `available` first."""
    return _built.module.norm_rows(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The batch-invariant mode's SiLU(gate) * up (gate, up of one shape and float dtype): `F.silu(gate) * up`'s
    roundings (the SiLU rounded to the dtype, then the product), with the package's own exp, whose bits are the same
    in every build and every lane (torch's vector exp need not match its scalar one); within a few ulp of torch's.
    `decoder_step` runs the same. Call `available` first."""
    return _built.module.silu_mul(gate, up)


def decoder_step(ids: torch.Tensor, embedding: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 weights: list[list[torch.Tensor]], k_cache: torch.Tensor, v_cache: torch.Tensor,
                 write_slots: torch.Tensor, queries: torch.Tensor, key_slots: torch.Tensor, counts: torch.Tensor,
                 head_rows: torch.Tensor, heads: int, kv_heads: int, intermediate: int, vocab: int,
                 eps: float) -> torch.Tensor:
    """One packed step of a LLaMA model (no biases, no q/k norms) in the batch-invariant mode, from its token ids to
    its logits, in one call: the embedding's rows, per layer the ops of `models.blocks`' forward as the mode runs them
    (`gemm` or `quant.gemm`, `rms_norm`, RoPE, `attention`, `silu_mul`, each output rounded to the dtype where torch's
    op rounds it), then the final norm and the head over the tokens whose logits are wanted: the same bits as running
    them from Python, with no Python and no ATen op between them.
    ids [T] int64 (each checked against `vocab`: IndexError); embedding: the table the rows come from (the embedding's
    weight [V, H] in the model's dtype, a tied head's `Packed.blocks`, or a `quant.pack` blob); cos, sin [1, T, 1, D]
    in the model's dtype; weights: six lists per layer (input norm weight, q/k/v side by side, o, post-attention norm
    weight, gate/up side by side, down), then the final norm's [weight] and the head's: [the norm's weight], [a weight
    packed by `pack`] or the linears' `quant.pack` blobs, one per linear, side by side; k_cache, v_cache [layers, Hkv,
    S, D], written at `write_slots` [T]; queries [R], the tokens that attend, each over its key slots [R, W] in
    position order (the first counts[r]; all three int64, as `attention` takes them); head_rows [R'] int64, the
    tokens whose logits are wanted. Returns the logits [1, R', vocab] in the model's dtype. Call `available` first."""
    return _built.module.decoder_step(ids, embedding, cos, sin, weights, k_cache, v_cache, write_slots, queries,
                                      key_slots, counts, head_rows, heads, kv_heads, intermediate, vocab, eps)


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's argmax of logits [R, V] (torch.argmax's answer: the first largest, NaN above every number), then for
    k > 0 each row's k largest ids, largest first, the lower id first among equals (torch.topk's order but for ties,
    which it leaves open): int64 [R + R * k], in one pass over each row. Call `available` first."""
    return _built.module.top_ids(logits, k)


def cpu_tag() -> str:
    """A short hash of this CPU's model and flags: the build is for this CPU alone (-march=native), so a cache folder
    shared by machines keeps one build per kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        facts = "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        facts = platform.processor()
    return hashlib.sha256(facts.encode()).hexdigest()[:12]


BF16_DOT_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # /proc/cpuinfo's names: x86's two, then aarch64's


def bf16_dot_products(cpuinfo: str | None = None) -> str | None:
    """The CPU feature that gives this CPU bfloat16 dot products (AMX, AVX512-BF16, Arm's BF16), as /proc/cpuinfo
    names it, or None (none of them, or no /proc/cpuinfo): where a bfloat16 model is read at half fp32's bytes
    without paying for it in slow conversions. cpuinfo: that file's text (None: read it)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return next((flag for flag in BF16_DOT_FLAGS if flag in flags), None)


def build_name() -> str:
    """The build's name: a hash of what it is made of (`lookahead.cpp_build`: sources, flags, compiler, this kind of
    CPU; steps' measured costs are kept per build)."""
    return cpp_build.build_name(_extension())


def extension():
    """The built extension module (None before `available` built it, or where it could not be built): for the other
    kernels compiled into it (`quant`)."""
    return _built.module


def failure() -> str | None:
    """Why the kernels could not be built (one line: "no C++ compiler found (c++: not found)"), or None."""
    return _built.failure


def _extension() -> cpp_build.Extension:
    # -march=native: the build is for this kind of CPU alone; no fused multiply-adds but those the kernels write
    return cpp_build.Extension(
        "lookahead_cpu_kernels", (CSRC / "cpu_kernels_module.cpp",), tuple(CSRC / n for n in SOURCE_FILES),
        cflags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *WARNINGS), ldflags=("-fopenmp",),
        target=cpu_tag(), what="the CPU kernels")


def _load(build_dir):
    return _built.get(_extension, lambda: build_dir or _default_root())


def _default_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()
