"""The lookahead attention over packed (varlen) steps and a paged KV cache: `paged_attention` and `PagedAttentionPlan`
against `paged_reference_attention` (FlagAttention's 2x rule), the reference against independent dense computations,
the input checks, and the plan's promises (no recompile, no host read, no mask)."""

import inspect
import math
import random

import pytest
import torch
from test_kernel import DEVICE, DTYPES, FLOOR, Recorder, constexpr_names
from test_pattern import TREES, ancestors, tree_end_of

import lookahead.kernels.triton_attention as module
from helpers import needs_triton
from lookahead.kernels import (
    PagedAttentionPlan,
    StepPattern,
    interpreting,
    paged_attention,
    paged_reference_attention,
    reference_attention,
)

pytestmark = needs_triton  # kernels on DEVICE: the GPU where there is one, else the interpreter

# a row's step by name: (W, N, tree_end), or None for an idle row (T = 0)
ROWS = {
    "plain": (1, 2, ()),  # plain decoding, T = 1
    "chunk7": (1, 2, (6,) * 6),  # a prefill chunk of 7 tokens: the input token and a path of 6
    "chunk40": (1, 2, (39,) * 39),  # 40 tokens: more than one key block
    "5-4-branchy": (5, 4, tuple(tree_end_of(TREES["branchy"]))),  # T = 15 + 9
    "3-3-star": (3, 3, tuple(tree_end_of(TREES["star"]))),  # T = 6 + 6
    "1-2-random3": (1, 2, tuple(tree_end_of(TREES["random3"]))),  # a tree-only step, T = 11
    "4-3-none": (4, 3, ()),  # the lookahead branch alone, T = 8
    "8-3-deep": (8, 3, tuple(tree_end_of(TREES["deep-chain"]))),  # T = 16 + 16: key blocks of the tree skip
    "idle": None,
}
MIXED = ["plain", "chunk40", "5-4-branchy", "idle", "1-2-random3", "3-3-star", "chunk7", "4-3-none", "8-3-deep"]
LENGTHS = [63, 0, 100, 5, 1, 17, 130, 16, 40]  # per row: 0, 1, 63, past a block, across several blocks


class Batch:
    """Random packed steps over a shuffled block pool, as `paged_attention` takes them."""

    def __init__(self, rows, lengths, *, dtype=torch.float32, heads_q=4, heads_kv=2, head_dim=16, block_size=16,
                 seed=0, layout="pool", shared_blocks=0, index_dtype=torch.int32, strided_q=False):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        steps = [ROWS[name] or (1, 2, None) for name in rows]
        tokens = [0 if tree is None else w * (n - 1) + len(tree) for w, n, tree in steps]
        cu = [0]
        for t in tokens:
            cu.append(cu[-1] + t)
        needed = [-(-(length + t) // block_size) if t else 0 for length, t in zip(lengths, tokens, strict=True)]
        # rows whose prefix holds `shared_blocks` whole blocks start with the same physical blocks (a shared prompt)
        sharing = [length >= shared_blocks * block_size and t > 0 for length, t in zip(lengths, tokens, strict=True)]
        own = [n - (shared_blocks if share else 0) for n, share in zip(needed, sharing, strict=True)]
        num_blocks = shared_blocks + sum(own) + 3  # 3 blocks no row uses
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        shared, ids = ids[:shared_blocks], ids[shared_blocks:]
        max_blocks = max(needed) + 1
        table = torch.full((len(rows), max_blocks), -1, dtype=index_dtype)  # entries past a row's need: never read
        for b, (n, share) in enumerate(zip(own, sharing, strict=True)):
            blocks = (shared if share else []) + ids[:n]
            ids = ids[n:]
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=index_dtype)
        if layout == "pool":  # [num_blocks, Hkv, block_size, D]
            k, v = torch.randn(2, num_blocks, heads_kv, block_size, head_dim, generator=gen).to(DEVICE, dtype)
        else:  # the model's per-layer [Hkv, num_blocks * block_size, D], passed as a permuted view
            kv = torch.randn(2, heads_kv, num_blocks * block_size, head_dim, generator=gen).to(DEVICE, dtype)
            k, v = (x.view(heads_kv, num_blocks, block_size, head_dim).permute(1, 0, 2, 3) for x in kv)
        total = cu[-1]
        if strided_q:
            q = torch.randn(total, heads_q, 2 * head_dim, generator=gen).to(DEVICE, dtype)[..., ::2]
        else:
            q = torch.randn(total, heads_q, head_dim, generator=gen).to(DEVICE, dtype)
        tree = [12345] * total  # lookahead tokens' entries are ignored: garbage
        for b, (w, n, ends) in enumerate(steps):
            if ends:
                tree[cu[b] + w * (n - 1) : cu[b + 1]] = ends
        ints = dict(dtype=index_dtype, device=DEVICE)
        self.q, self.k, self.v, self.table = q, k, v, table.to(DEVICE)
        self.cu_seqlens = torch.tensor(cu, **ints)
        self.prefix_len = torch.tensor(lengths, **ints)
        self.window = torch.tensor([w for w, _, _ in steps], **ints)
        self.ngram = torch.tensor([n for _, n, _ in steps], **ints)
        self.tree_end = torch.tensor(tree, **ints)
        self.steps, self.lengths, self.tokens = steps, list(lengths), tokens

    def args(self):
        return (self.q, self.k, self.v, self.table, self.cu_seqlens, self.prefix_len, self.window, self.ngram,
                self.tree_end)


def check_against_reference(batch, out=None, num_splits=None):
    """The kernel (public entry, or a plan with a forced split count) within 2x eager's error of the fp32 reference."""
    if out is None and num_splits is None:
        out = paged_attention(*batch.args())
    elif out is None:
        out = plan_for(batch, num_splits=num_splits)(*batch.args())
    ref = paged_reference_attention(*batch.args(), upcast=True)
    eager = paged_reference_attention(*batch.args(), upcast=False)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape and out.is_contiguous()
    budget = 2 * (eager.float() - ref.float()).abs().max().item() + FLOOR[batch.q.dtype]
    error = (out.float() - ref.float()).abs().max().item()
    assert error <= budget, f"max error {error:.3g} > budget {budget:.3g}"


def plan_for(batch, **kwargs):
    q, k = batch.q, batch.k
    return PagedAttentionPlan(heads_q=q.shape[1], heads_kv=k.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                              device=q.device, max_rows=len(batch.tokens), max_row_tokens=max(batch.tokens),
                              max_len=max(batch.lengths), **kwargs)


@pytest.mark.parametrize("block_size", [16, 5], ids=lambda n: f"bs{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch_matches_reference(dtype, block_size):
    """Plain rows, prefill chunks, lookahead steps with trees, a tree-only step, an idle row, per-row L and (W, N),
    over shuffled blocks with partial last blocks; any block size (5: tiles span several blocks, unaligned)."""
    check_against_reference(Batch(MIXED, LENGTHS, dtype=dtype, block_size=block_size))


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (4, 2), (8, 2)], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [16, 64], ids=lambda d: f"D{d}")
def test_head_layouts(heads_q, heads_kv, head_dim):
    rows = ["5-4-branchy", "plain", "chunk7"]
    check_against_reference(Batch(rows, [40, 63, 0], heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, seed=1))


@pytest.mark.parametrize("layout", ["pool", "model"])
def test_pool_layouts_shared_blocks_and_strided_q(layout):
    """The pool as [num_blocks, Hkv, block_size, D] or as a permuted view of the model's [Hkv, blocks x size, D];
    rows sharing their first 2 physical blocks (a common prompt prefix); q with a strided head dim; int64 indices."""
    batch = Batch(["3-3-star", "plain", "chunk7", "idle"], [40, 33, 70, 0], block_size=16, layout=layout,
                  shared_blocks=2, index_dtype=torch.int64, strided_q=True, dtype=torch.float16, seed=2)
    assert batch.table[0, 0] == batch.table[1, 0] == batch.table[2, 0] and batch.table[0, 1] == batch.table[2, 1]
    assert not batch.q.is_contiguous() and (layout == "pool") == batch.k.is_contiguous()
    check_against_reference(batch)


@pytest.mark.parametrize("num_splits", [1, 3, 8], ids=lambda s: f"S{s}")
def test_plan_splits_of_the_prefix(num_splits):
    """A plan's fixed split count over rows whose prefixes end at, before and past the fp16 key tile (64) and
    blocks, empty splits included; with idle rows."""
    batch = Batch(["5-4-branchy", "idle", "plain", "chunk7", "1-2-random3"], [65, 9, 300, 63, 64], block_size=16,
                  dtype=torch.float16, seed=3)
    check_against_reference(batch, num_splits=num_splits)


def test_each_call_splits_the_prefix_by_its_own_rows_and_tokens():
    """A plan sized for 8 rows of 40-token steps splits a lone plain row's long prefix more than its largest call's
    (more programs for the SMs: 1 query tile x 4 KV heads, not 8 rows' worth), and computes it right."""
    lone = Batch(["plain"], [1900], dtype=torch.float16, heads_q=8, heads_kv=4, seed=5)
    plan = PagedAttentionPlan(heads_q=8, heads_kv=4, head_dim=16, dtype=torch.float16, device=DEVICE, max_rows=8,
                              max_row_tokens=40, max_len=2000)
    assert plan.splits(1, 1) > plan.num_splits == plan.splits(8, 320) >= 1
    check_against_reference(lone, plan(*lone.args()))


def test_plan_pads_tokens_past_the_last_row_with_zeros():
    """A CUDA graph's bucket: q holds more tokens than cu_seqlens[B]; they belong to no row and come out as zeros."""
    batch = Batch(["plain", "3-3-star"], [20, 7], seed=4)
    extra = torch.randn(5, *batch.q.shape[1:], device=DEVICE)
    padded_q = torch.cat([batch.q, extra])
    args = list(batch.args())
    args[0], args[-1] = padded_q, torch.cat([batch.tree_end, batch.tree_end.new_zeros(5)])
    out = plan_for(batch)(*args)
    assert torch.equal(out[-5:], torch.zeros_like(extra))
    check_against_reference(batch, out=out[:-5])


def dense_layout(batch):
    """Each row's positions gathered through its table into a dense [B, Hkv, S, D] cache."""
    rows = []
    for b, (length, t) in enumerate(zip(batch.lengths, batch.tokens, strict=True)):
        positions = torch.arange(length + t, device=DEVICE)
        blocks = batch.table[b][positions // batch.k.shape[2]]
        rows.append([x[blocks, :, positions % x.shape[2]].transpose(0, 1) for x in (batch.k, batch.v)])
    width = max(x.shape[1] for x, _ in rows)
    return [torch.stack([torch.nn.functional.pad(r[i], (0, 0, 0, width - r[i].shape[1])) for r in rows])
            for i in (0, 1)]


def test_reference_equals_the_dense_reference():
    """Rows of one step shape: the paged reference equals `reference_attention` on the same data laid out densely
    (per-row L, per-row trees [B, V])."""
    batch = Batch(["5-4-branchy"] * 3, [0, 37, 70], seed=5)
    k, v = dense_layout(batch)
    t = batch.tokens[0]
    q = batch.q.view(3, t, *batch.q.shape[1:]).transpose(1, 2)
    trees = batch.tree_end.view(3, t)[:, 15:]
    dense = reference_attention(q, k, v, batch.prefix_len, 5, 4, 0, tree_end=trees)
    dense = dense.transpose(1, 2).reshape(3 * t, 4, 16)
    torch.testing.assert_close(paged_reference_attention(*batch.args()), dense, rtol=1e-5, atol=1e-5)


def test_reference_equals_softmax_over_the_design_rule():
    """A mixed batch against attention computed query by query over the keys docs/DESIGN.md says it sees (the whole
    prefix; in the step, the lookahead rule or the input token and the node's ancestors), by explicit softmax."""
    batch = Batch(["3-3-star", "idle", "chunk7", "plain"], [21, 3, 2, 0], heads_q=2, heads_kv=1, seed=6)
    k, v = dense_layout(batch)
    out = torch.zeros_like(batch.q)
    for b, ((w, n, ends), length, t) in enumerate(zip(batch.steps, batch.lengths, batch.tokens, strict=True)):
        if not t:
            continue
        la = w * (n - 1)
        parents = [-1] * len(ends)
        for j in range(len(ends)):  # a node's parent: the nearest earlier node whose subtree holds it
            parents[j] = max((a for a in range(j) if ends[a] > j), default=-1)
        for i in range(t):
            if i < la:
                seen = {c for c in range(i % w + 1)} | {w * level + i % w for level in range(1, i // w + 1)}
            else:
                seen = {0} | {la + a for a in ancestors(parents, i - la)}
            keys = list(range(length)) + [length + s for s in sorted(seen)]
            scores = batch.q[batch.cu_seqlens[b] + i] @ k[b, 0, keys].T / math.sqrt(16)  # [Hq, keys]
            out[batch.cu_seqlens[b] + i] = scores.softmax(-1) @ v[b, 0, keys]
    torch.testing.assert_close(paged_reference_attention(*batch.args()), out, rtol=1e-5, atol=1e-5)


def test_classic_entry_is_the_paged_kernel_on_one_block_per_row():
    """`lookahead_attention` (dense) and `paged_attention` on the same rows give the same output."""
    from lookahead.kernels import lookahead_attention

    batch = Batch(["3-3-star"] * 2, [30, 9], dtype=torch.float16, seed=7)
    k, v = dense_layout(batch)
    t = batch.tokens[0]
    q = batch.q.view(2, t, *batch.q.shape[1:]).transpose(1, 2)
    dense = lookahead_attention(q, k, v, batch.prefix_len, 3, 3, 0, tree_end=batch.tree_end.view(2, t)[:, 6:])
    paged = paged_attention(*batch.args())
    torch.testing.assert_close(dense.transpose(1, 2).reshape(paged.shape), paged, rtol=0, atol=2e-3)


def specialisation(kernel, args, kwargs):
    """What Triton keys a compiled kernel by: the constexprs, tensor dtypes and alignment, and for the ints it
    specialises, whether they are 1 or divisible by 16 (the interpreter compiles nothing, so this is computed)."""
    if hasattr(kernel, "params"):  # a JITFunction (on a GPU)
        unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
    else:  # the interpreter's function keeps the decorator's arguments
        unspecialised = set(kernel.kwargs.get("do_not_specialize", ()))
    constexprs = constexpr_names(kernel)
    names = list(inspect.signature(kernel.fn).parameters)
    values = dict(zip(names, args, strict=False)) | {n: kwargs[n] for n in names[len(args):]}
    key = []
    for name in names:
        value = values[name]
        if name in constexprs:
            key.append(value)
        elif isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in unspecialised:
            key.append((value == 1, value % 16 == 0))
        else:
            key.append(type(value).__name__)
    return tuple(key)


def test_plan_replays_new_steps_without_recompiling_or_reading_the_device(monkeypatch):
    """One plan, called on one batch and then on another with other T_b, L_b, W_b, N_b, trees and tables (the
    tensors of a CUDA graph's replay, refilled in place) and on a third with fewer tokens: every launch has one
    specialisation, and the launcher reads no device value on the host (the interpreter's own reads are allowed)."""
    first = Batch(["5-4-branchy", "plain", "chunk7"], [70, 3, 20], seed=8)
    second = Batch(["chunk7", "3-3-star", "4-3-none", "plain"], [150, 0, 31, 1], seed=9)
    third = Batch(["plain", "idle", "chunk7"], [2, 1, 15], seed=10)
    plan = PagedAttentionPlan(heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32, device=DEVICE, max_rows=4,
                              max_row_tokens=24, max_len=150)
    launches = {name: Recorder(getattr(module, name)) for name in ("_lookahead_attn_split", "_lookahead_attn_merge")}
    reading = [False]

    def forbidden(*args, **kwargs):
        raise AssertionError("the plan read a device value on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, **k: (
            _real(self, *a, **k) if reading[0] else forbidden()))

    class Running(Recorder):  # the kernel itself (the interpreter) may read its arguments
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.launches.append((args, kwargs))
                reading[0] = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    reading[0] = False

            return launch

    for name, recorder in launches.items():
        monkeypatch.setattr(module, name, Running(recorder.kernel))
    outs = [plan(*batch.args()) for batch in (first, second, third)]
    recorded = {name: getattr(module, name).launches for name in launches}
    monkeypatch.undo()
    for name, calls in recorded.items():
        kernel = launches[name].kernel
        assert len(calls) == 3
        assert {specialisation(kernel, args, kwargs) for args, kwargs in calls}.__len__() == 1, name
        assert all(set(kwargs) - {"num_warps", "num_stages"} == constexpr_names(kernel) for _, kwargs in calls)
    for batch, out in zip((first, second, third), outs, strict=True):
        check_against_reference(batch, out=out)


def test_kernel_builds_no_mask(monkeypatch):
    batch = Batch(MIXED[:5], LENGTHS[:5], seed=11)

    def forbidden(*args, **kwargs):
        raise AssertionError("a dense mask was built on the kernel path")

    monkeypatch.setattr(StepPattern, "materialize", forbidden)
    monkeypatch.setattr(StepPattern, "visible", forbidden)
    paged_attention(*batch.args())
    plan_for(batch, num_splits=2)(*batch.args())


def bad_case(change):
    """A valid small batch's arguments (as a dict), then `change` applied to it."""
    batch = Batch(["3-3-star", "plain"], [10, 4], block_size=8, seed=12)
    args = dict(zip(("q", "k_cache", "v_cache", "block_table", "cu_seqlens", "prefix_len", "window", "ngram",
                     "tree_end"), batch.args(), strict=True))
    change(args)
    return args


def _set(**values):
    def change(args):
        for name, value in values.items():
            args[name] = value(args) if callable(value) else value

    return change


def _ints(*values):
    return torch.tensor(values, device=DEVICE)


CHECKS = [
    ("cache-list", _set(k_cache=lambda a: a["k_cache"].tolist()), TypeError,
     "k_cache must be a torch.Tensor, got list"),
    ("q-2d", _set(q=lambda a: a["q"][:, 0]), ValueError, r"q must be 3-D \[ΣT, Hq, D\]"),
    ("kv-shapes", _set(v_cache=lambda a: a["v_cache"][:, :, :4]), ValueError, "equal shapes"),
    ("head-dim", _set(k_cache=lambda a: a["k_cache"][..., :8], v_cache=lambda a: a["v_cache"][..., :8]),
     ValueError, "share a head dim"),
    ("gqa", _set(q=lambda a: a["q"][:, :3]), ValueError, r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    ("dtype", _set(k_cache=lambda a: a["k_cache"].half()), TypeError, "must share a dtype"),
    ("int-q", _set(q=lambda a: a["q"].int()), TypeError, "unsupported dtype"),
    ("table-1d", _set(block_table=lambda a: a["block_table"][0]), ValueError, "block_table must be a 2-D"),
    ("table-float", _set(block_table=lambda a: a["block_table"].float()), TypeError,
     "block_table must be an integer tensor"),
    ("cu-shape", _set(cu_seqlens=_ints(0, 12)), ValueError, r"cu_seqlens must have shape \[3\]"),
    ("cu-start", _set(cu_seqlens=_ints(1, 12, 13)), ValueError, r"cu_seqlens must start at 0.*got \[1, 12, 13\]"),
    ("cu-decreasing", _set(cu_seqlens=_ints(0, 13, 12)), ValueError, "never decrease"),
    ("cu-total", _set(cu_seqlens=_ints(0, 12, 12)), ValueError, "end at q's 13 tokens"),
    ("prefix-negative", _set(prefix_len=_ints(10, -1)), ValueError, r"prefix_len must be >= 0.*prefix_len\[1\] = -1"),
    ("window-0", _set(window=_ints(3, 0)), ValueError, r"window must be >= 1.*window\[1\] = 0"),
    ("ngram-1", _set(ngram=_ints(1, 2)), ValueError, r"ngram must be >= 2.*ngram\[0\] = 1"),
    ("prefix-float", _set(prefix_len=lambda a: a["prefix_len"].float()), TypeError,
     "prefix_len must be an integer tensor"),
    ("window-shape", _set(window=_ints(3, 1, 1)), ValueError, r"window must have shape \[2\]"),
    ("too-few-tokens", _set(window=_ints(7, 1)), ValueError, r"row 0 has 12 step tokens.*window=7, ngram=3"),
    ("tree-shape", _set(tree_end=lambda a: a["tree_end"][:-1]), ValueError, r"tree_end must have shape \[13\]"),
    ("tree-range", _set(tree_end=lambda a: a["tree_end"].index_fill(0, _ints(7), 9)), ValueError,
     r"row 0's tree_end\[1\] must be in \(1, 6\], got 9"),
    ("tree-nesting", _set(tree_end=lambda a: a["tree_end"].index_put((_ints(6, 7),), a["tree_end"].new_tensor([2, 3]))),
     ValueError, "leaves its parent's subtree"),
    ("table-short", _set(prefix_len=_ints(100, 4)), ValueError, "row 0 reads prefix_len \\+ T = 100 \\+ 12"),
    ("table-range", _set(block_table=lambda a: a["block_table"].index_fill(1, _ints(0), 99)), ValueError,
     r"block_table\[0\] holds block 99 outside the pool"),
    ("sm-scale", lambda a: a.update(sm_scale=math.inf), ValueError, "sm_scale must be a finite positive number"),
    ("device", _set(cu_seqlens=lambda a: a["cu_seqlens"].to("meta")), ValueError,
     "cu_seqlens must be on q's device"),
]


@pytest.mark.parametrize("change, error, message", [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_input_checks(change, error, message):
    with pytest.raises(error, match=message):
        paged_attention(**bad_case(change))


def test_idle_and_empty_batches():
    batch = Batch(["idle", "idle"], [3, 0])
    assert paged_attention(*batch.args()).shape == (0, 4, 16)


@pytest.mark.parametrize("bad, message", [
    (dict(max_rows=0), "max_rows must be an int >= 1"),
    (dict(max_row_tokens=0), "max_row_tokens must be an int >= 1"),
    (dict(max_len=-1), "max_len must be an int >= 0"),
    (dict(heads_q=6, heads_kv=4), "multiple of KV heads"),
    (dict(num_splits=0), r"num_splits must be an int in \[1, 65535\]"),
    (dict(max_rows=40000), "exceeds the grid's 65535"),
])
def test_plan_checks_once(bad, message):
    args = dict(heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32, device=DEVICE, max_rows=2,
                max_row_tokens=8, max_len=64)
    with pytest.raises(ValueError, match=message):
        PagedAttentionPlan(**{**args, **bad})


@pytest.mark.skipif(not interpreting(), reason="the interpreter's bf16 refusal")
def test_refuses_bf16_under_the_interpreter():
    batch = Batch(["plain"], [3], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="computes bf16 dots wrongly"):
        paged_attention(*batch.args())
    with pytest.raises(ValueError, match="computes bf16 dots wrongly"):
        plan_for(batch)


@pytest.mark.skipif(interpreting() is False and not torch.cuda.is_available(), reason="needs Triton")
def test_refuses_cpu_tensors_outside_interpreter(monkeypatch):
    monkeypatch.setattr(module, "interpreting", lambda: False)
    batch = Batch(["plain"], [3])
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*paged_reference_attention"):
        paged_attention(*(x.cpu() for x in batch.args()))
