"""The Triton lookahead attention (split-K over the prefix, then a merge) against the SDPA reference, its launch
plan, its input checks, and the KV commit."""

import inspect
import math
import re

import pytest
import torch
from test_pattern import TREES, chain_tree, tree_end_of

import lookahead.kernels.triton_attention as module
from helpers import needs_triton
from lookahead.kernels import (
    StepAttentionPlan,
    StepPattern,
    commit_accepted,
    interpreting,
    lookahead_attention,
    reference_attention,
)
from lookahead.kernels.triton_attention import launch_config, num_splits_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_triton  # kernels on DEVICE: the GPU where there is one, else the interpreter
# allowed error on top of 2x eager's (FlagAttention's rule); fp32 leaves room for TF32-level error
FLOOR = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
NO_BF16 = "the Triton interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584); GPU only"
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(interpreting(), reason=NO_BF16))]


def make_step(W, N, g, prefix_len, dtype, batch=1, heads_q=4, heads_kv=2, head_dim=64, slack=5, seed=0, tokens=None):
    """Random q [B, Hq, T, D] (a transposed view, as the model passes it) and k, v with `slack` spare positions."""
    gen = torch.Generator().manual_seed(seed)
    t = tokens if tokens is not None else StepPattern(W, N, g).num_tokens
    length = int(max(prefix_len)) if isinstance(prefix_len, (list, torch.Tensor)) else prefix_len
    q = torch.randn(batch, t, heads_q, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, heads_kv, length + t + slack, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(batch, heads_kv, length + t + slack, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v


def run_plan(q, k, v, prefix_len, W, N, g, tree_end=None, num_splits=None):
    """The model's path: a plan built once, called with a device prefix_len tensor."""
    batch, heads_q, _, head_dim = q.shape
    lengths = prefix_len if isinstance(prefix_len, torch.Tensor) else torch.full((batch,), prefix_len)
    if tree_end is None:
        pattern = StepPattern(W, N, g)
    else:  # a plan knows V from its pattern; per-row trees come with the call
        pattern = StepPattern(W, N, tree_end=(tree_end[0] if tree_end.ndim == 2 else tree_end).tolist())
    plan = StepAttentionPlan(pattern, batch=batch, heads_q=heads_q, heads_kv=k.shape[1], head_dim=head_dim,
                             dtype=q.dtype, device=q.device, max_len=int(lengths.max()), num_splits=num_splits)
    return plan(q, k, v, lengths.to(DEVICE, torch.int64), tree_end)


def check_against_reference(q, k, v, prefix_len, W, N, g, tree_end=None, num_splits=None):
    if num_splits is None:
        out = lookahead_attention(q, k, v, prefix_len, W, N, g, tree_end=tree_end)
    else:
        out = run_plan(q, k, v, prefix_len, W, N, g, tree_end, num_splits)
    ref = reference_attention(q, k, v, prefix_len, W, N, g, upcast=True, tree_end=tree_end)
    eager = reference_attention(q, k, v, prefix_len, W, N, g, upcast=False, tree_end=tree_end)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert out.transpose(1, 2).is_contiguous()  # free `out.transpose(1, 2).reshape(B, T, Hq * D)` for o_proj
    budget = 2 * (eager.float() - ref.float()).abs().max().item() + FLOOR[q.dtype]
    error = (out.float() - ref.float()).abs().max().item()
    assert error <= budget, f"max error {error:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("W, N, g", [(1, 2, 0), (5, 4, 0), (5, 4, 2), (3, 3, 3), (15, 5, 15), (7, 2, 7)],
                         ids=lambda v: None)
@pytest.mark.parametrize("prefix_len", [0, 70], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference(W, N, g, prefix_len, dtype):
    check_against_reference(*make_step(W, N, g, prefix_len, dtype), prefix_len, W, N, g)


@pytest.mark.parametrize("num_splits", [1, 3, 8], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("prefix_len", [0, 1, 63, 64, 65, 300], ids=lambda n: f"L{n}")
def test_kernel_splits_of_the_prefix(prefix_len, num_splits):
    """Every split count over lengths at block edges (BLOCK_N = 64 in fp16), empty splits included."""
    q, k, v = make_step(5, 4, 2, prefix_len, torch.float16)
    check_against_reference(q, k, v, prefix_len, 5, 4, 2, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "S3"])
def test_kernel_ragged_batch(num_splits):
    """Per-row prefix lengths [0, 37, 130] in one call, read on the device."""
    lengths = torch.tensor([0, 37, 130], device=DEVICE)
    q, k, v = make_step(3, 4, 3, lengths, torch.float32, batch=3)
    check_against_reference(q, k, v, lengths, 3, 4, 3, num_splits=num_splits)


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 48, 128], ids=lambda d: f"D{d}")
def test_kernel_head_layouts(heads_q, heads_kv, head_dim):
    W, N, g, prefix_len = 4, 3, 2, 33
    q, k, v = make_step(W, N, g, prefix_len, torch.float32, batch=2, heads_q=heads_q, heads_kv=heads_kv,
                        head_dim=head_dim)
    check_against_reference(q, k, v, prefix_len, W, N, g, num_splits=2)


def test_kernel_non_contiguous_inputs():
    """q with a strided head dim, k/v stored [B, S, H, D] with every other position (any strides are read)."""
    W, N, g, prefix_len, d = 3, 4, 2, 40, 32
    t = StepPattern(W, N, g).num_tokens
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, t, 4, 2 * d, generator=gen).to(DEVICE, torch.float16).transpose(1, 2)[..., ::2]
    k = torch.randn(2, 2 * (prefix_len + t), 2, d, generator=gen).to(DEVICE, torch.float16).transpose(1, 2)[:, :, ::2]
    v = torch.randn(2, 2, prefix_len + t, 2 * d, generator=gen).to(DEVICE, torch.float16)[..., d:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or q.stride(-1) == 1)
    check_against_reference(q, k, v, prefix_len, W, N, g)
    check_against_reference(q, k, v, prefix_len, W, N, g, num_splits=3)


SHAPES = ["empty", "single-path", "star", "deep-chain", "padding-leaves", "branchy", "random3", "random5"]
TREE_STEPS = [(1, 2, name) for name in SHAPES] + [(3, 4, name) for name in SHAPES]
TREE_STEPS += [(15, 5, name) for name in ("deep-chain", "padding-leaves", "random5")]  # T > BLOCK_N: key blocks skip


@pytest.mark.parametrize("W, N, name", TREE_STEPS, ids=[f"W{w}-N{n}-{name}" for w, n, name in TREE_STEPS])
def test_kernel_trees(W, N, name):
    tree_end = torch.tensor(tree_end_of(TREES[name]), dtype=torch.int64, device=DEVICE)
    q, k, v = make_step(W, N, 0, 70, torch.float32, tokens=W * (N - 1) + len(tree_end))
    check_against_reference(q, k, v, 70, W, N, 0, tree_end=tree_end, num_splits=2)


def test_kernel_per_row_trees_and_lengths():
    """[B, V] trees (one per row, same V) with per-row prefix lengths; chains written as a tree in row 0."""
    rows = [chain_tree(4, 3), tree_end_of(TREES["branchy"]), tree_end_of(TREES["star"][:3] + [-1] * 6)]
    tree_end = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([65, 0, 17], device=DEVICE)
    q, k, v = make_step(3, 4, 0, lengths, torch.float16, batch=3, tokens=9 + 9)
    check_against_reference(q, k, v, lengths, 3, 4, 0, tree_end=tree_end)
    check_against_reference(q, k, v, lengths, 3, 4, 0, tree_end=tree_end.long(), num_splits=3)
    # chains as trees give the chains output
    chains = lookahead_attention(q[:1], k[:1], v[:1], 65, 3, 4, 3)
    tree = lookahead_attention(q[:1], k[:1], v[:1], 65, 3, 4, 0, tree_end=tree_end[0])
    assert torch.equal(chains, tree)


class Recorder:
    """Wraps a kernel global: records each launch's keyword (compile-time) arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((len(args), tuple(sorted(kwargs.items()))))
            return self.kernel[grid](*args, **kwargs)

        return launch


def constexpr_names(kernel):
    return {p.name for p in inspect.signature(kernel.fn).parameters.values() if "constexpr" in str(p.annotation)}


def test_kernel_runtime_g_shares_one_compiled_kernel(monkeypatch):
    """g < G: the candidates present are a run-time argument, so every g launches the same constexpr set; chains are
    read as their tree, so a tree step of the same tile size launches it too."""
    recorders = {name: Recorder(getattr(module, name)) for name in ("_lookahead_attn_split", "_lookahead_attn_merge")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    for g in (1, 3):
        check_against_reference(*make_step(3, 4, g, 70, torch.float32), 70, 3, 4, g)
    tree = torch.tensor(tree_end_of(TREES["branchy"]), device=DEVICE)
    check_against_reference(*make_step(3, 4, 0, 70, torch.float32, tokens=18), 70, 3, 4, 0, tree_end=tree)
    for name, recorder in recorders.items():
        kernel = recorder.kernel
        n_params = len(inspect.signature(kernel.fn).parameters)
        for n_args, kwargs in recorder.launches:  # every constexpr by keyword, nothing else by keyword
            assert {key for key, _ in kwargs} - {"num_warps", "num_stages"} == constexpr_names(kernel)
            assert n_args + len(constexpr_names(kernel)) == n_params
        compiled = {kwargs for _, kwargs in recorder.launches}
        assert len(recorder.launches) == 3 and len(compiled) == 1, (name, recorder.launches)


def test_plan_replays_with_new_lengths_and_no_host_reads(monkeypatch):
    """One plan, called again after the device prefix_len changed in place (a CUDA graph's replay)."""
    W, N, g = 3, 4, 3
    q, k, v = make_step(W, N, g, 150, torch.float16, batch=2)
    plan = StepAttentionPlan(StepPattern(W, N, g), batch=2, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.float16,
                             device=q.device, max_len=150)
    lengths = torch.tensor([150, 3], device=DEVICE)
    first = plan(q, k, v, lengths)
    lengths.copy_(torch.tensor([20, 149]))

    def forbidden(*args, **kwargs):
        raise AssertionError("the plan read a device value on the host")

    if not interpreting():  # the interpreter itself reads tensors on the host
        monkeypatch.setattr(torch.Tensor, "item", forbidden)
        monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    second = plan(q, k, v, lengths)
    monkeypatch.undo()
    for out, lens in ((first, [150, 3]), (second, [20, 149])):
        ref = reference_attention(q, k, v, torch.tensor(lens), W, N, g, upcast=True)
        assert (out.float() - ref.float()).abs().max().item() < 2e-3


def test_kernel_builds_no_mask(monkeypatch):
    q, k, v = make_step(5, 4, 2, 20, torch.float32)
    tree_q, tree_k, tree_v = make_step(5, 4, 0, 20, torch.float32, tokens=15 + 6)
    tree_end = torch.tensor(tree_end_of(TREES["branchy"][:6]), device=DEVICE)

    def forbidden(*args, **kwargs):
        raise AssertionError("a dense mask was built on the kernel path")

    monkeypatch.setattr(StepPattern, "materialize", forbidden)
    lookahead_attention(q, k, v, 20, 5, 4, 2)
    lookahead_attention(tree_q, tree_k, tree_v, 20, 5, 4, 0, tree_end=tree_end)
    run_plan(q, k, v, 20, 5, 4, 2, num_splits=2)
    run_plan(tree_q, tree_k, tree_v, 20, 5, 4, 0, tree_end=tree_end)


def test_split_count_rule():
    """~1 wave of 132 SMs at B = 1, Hq 32 / Hkv 8, D 128: ~4 splits for T = 120, 16-32 for T <= 18."""

    def splits(W, N, g, max_len):
        pattern = StepPattern(W, N, g)
        config = launch_config(pattern.num_tokens, 4, 128, torch.float16)
        rows = pattern.num_tokens * 4
        return num_splits_for(math.ceil(rows / config["BLOCK_M"]) * 8, rows, max_len, config["BLOCK_N"], 132)

    assert splits(15, 5, 15, 4096) == 4  # T = 120
    assert 16 <= splits(3, 4, 3, 4096) <= 32  # T = 18
    assert 16 <= splits(1, 2, 0, 4096) <= 32  # plain decoding
    assert splits(3, 4, 3, 256) == 1  # a few K/V blocks per split at least
    assert splits(1, 2, 0, 0) == 1


@pytest.mark.parametrize("case, error, message", [
    (dict(v_list=True), TypeError, "v must be a torch.Tensor, got list"),
    (dict(q_3d=True), ValueError, "must be 4-D"),
    (dict(guesses=3), ValueError, r"needs \(W \+ g\) \* \(N - 1\)"),
    (dict(heads_kv=4), ValueError, "multiple of KV heads"),
    (dict(heads_kv=0), ValueError, "at least one head"),
    (dict(head_dim=0), ValueError, "head dim must be >= 1"),
    (dict(prefix_len=-1), ValueError, "prefix_len must be an int >= 0"),
    (dict(prefix_len=100), ValueError, "k/v hold"),
    (dict(prefix_len=[-1]), ValueError, "prefix_len must be an int >= 0"),
    (dict(prefix_len=[10, 10]), ValueError, r"prefix_len must have shape \[1\]"),
    (dict(prefix_len=[10.0]), TypeError, "prefix_len must be an integer tensor"),
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(ngram=1), ValueError, "ngram must be >= 2"),
    (dict(guesses=-1), ValueError, "candidates must be >= 0"),
    (dict(k_dtype=torch.float16), TypeError, "must share a dtype"),
    (dict(int_q=True), TypeError, "unsupported dtype"),
    (dict(sm_scale=math.inf), ValueError, "sm_scale must be a finite positive number"),
    (dict(sm_scale=math.nan), ValueError, "sm_scale must be a finite positive number"),
    (dict(sm_scale=0.0), ValueError, "sm_scale must be a finite positive number"),
    (dict(tree_end=[1, 2, 3, 4, 5, 5]), ValueError, r"tree_end\[5\] must be in \(5, 6\]"),
    (dict(tree_end=[2, 3, 3]), ValueError, "leaves its parent's subtree"),
    (dict(tree_end=[1, 2, 3, 4]), ValueError, r"V=4 needs W\(N - 1\) \+ V = 19"),
    (dict(tree_end=[[1, 2, 3, 4, 5, 6]] * 2), ValueError, r"tree_end must have shape \[6\] or \[1, 6\]"),
    (dict(tree_end=[0.5] * 6), TypeError, "tree_end must be an integer tensor"),
])
def test_kernel_input_checks(case, error, message):
    q, k, v = make_step(5, 4, 2, 10, torch.float32, heads_q=6, heads_kv=2)
    if case.get("q_3d"):
        q = q[0]
    if "heads_kv" in case:
        k = v = torch.zeros(1, case["heads_kv"], 40, 64, device=DEVICE)
    if "head_dim" in case:
        q, k, v = q[..., :0], k[..., :0], v[..., :0]
    if "k_dtype" in case:
        k = k.to(case["k_dtype"])
    if case.get("int_q"):
        q, k, v = q.int(), k.int(), v.int()
    if case.get("v_list"):
        v = v.tolist()
    args = dict(prefix_len=10, window=5, ngram=4, guesses=2)
    args.update({key: case[key] for key in ("prefix_len", "window", "ngram", "guesses", "sm_scale") if key in case})
    if isinstance(args["prefix_len"], list):
        args["prefix_len"] = torch.tensor(args["prefix_len"], device=DEVICE)
    if "tree_end" in case:
        args["tree_end"] = torch.tensor(case["tree_end"], device=DEVICE)
    with pytest.raises(error, match=message):
        lookahead_attention(q, k, v, **args)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's bf16 refusal")
def test_kernel_refuses_bf16_under_the_interpreter():
    q, k, v = make_step(1, 2, 0, 3, torch.float32)
    with pytest.raises(ValueError, match="computes bf16 dots wrongly.*float16 or float32.*GPU"):
        lookahead_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 3, 1, 2, 0)
    with pytest.raises(ValueError, match="computes bf16 dots wrongly"):
        StepAttentionPlan(StepPattern(1, 2, 0), batch=1, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.bfloat16,
                          device=DEVICE, max_len=3)


@pytest.mark.parametrize("bad, message", [
    (dict(heads_kv=0), "heads_kv must be an int >= 1"),
    (dict(head_dim=0), "head_dim must be an int >= 1"),
    (dict(heads_q=6, heads_kv=4), "multiple of KV heads"),
    (dict(sm_scale=math.inf), "sm_scale must be a finite positive number"),
    (dict(num_splits=0), r"num_splits must be an int in \[1, 65535\]"),
    (dict(max_len=-1), "max_len must be an int >= 0"),
])
def test_plan_checks_once(bad, message):
    args = dict(batch=1, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.float32, device=DEVICE, max_len=8)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        StepAttentionPlan(StepPattern(1, 2, 0), **args)


@pytest.mark.skipif(interpreting() is False and not torch.cuda.is_available(), reason="needs Triton")
def test_kernel_refuses_cpu_tensors_outside_interpreter(monkeypatch):
    monkeypatch.setattr(module, "interpreting", lambda: False)
    q, k, v = make_step(1, 2, 0, 3, torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        lookahead_attention(q.cpu(), k.cpu(), v.cpu(), 3, 1, 2, 0)


def test_commit_moves_accepted_entries_in_every_layer():
    layers, L, T = 3, 7, 12
    k = torch.randn(layers, 1, 2, L + T + 4, 8)
    v = torch.randn_like(k)
    k0, v0 = k.clone(), v.clone()
    accepted = [0, 5, 6, 9]
    commit_accepted(k, v, L, accepted)
    for j, i in enumerate(accepted):
        assert torch.equal(k[..., L + j, :], k0[..., L + i, :])
        assert torch.equal(v[..., L + j, :], v0[..., L + i, :])
    assert torch.equal(k[..., :L, :], k0[..., :L, :])  # the prefix is untouched


@pytest.mark.parametrize("indices", [[0, 3, 3], [2, 1], [-1, 0]])
def test_commit_rejects_unordered_indices(indices):
    k = torch.zeros(1, 1, 20, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        commit_accepted(k, k.clone(), 2, indices)


FUSED_STACK_BYTES = 64


def test_kernel_compiles_for_hopper_and_ampere():
    """No GPU needed: Triton compiles both kernels (and the fused ones) for sm_90 and sm_80 as they launch (run-time
    specialisations included), so GPU-only lowering errors and register spills show here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" OK ") == 18 + 5, run.stdout  # the DEFAULT and FUSED_DEFAULT cases of compile_for_gpu.py
    for line in run.stdout.splitlines():  # 16-bit tiles are sized to keep every value in registers
        frames = [int(n) for n in re.findall(r"spill (\d+) B", line)]
        assert len(frames) == line.count("regs") == (3 if " fused " in line else 2), line
        # the attention kernels keep no stack frame; an elementwise fused kernel may get a small one (Triton 3.6, the
        # GPU image's, gives the rotary kernel 32 bytes where 3.9 gives none): it touches each element once
        assert max(frames) <= (FUSED_STACK_BYTES if " fused " in line else 0), line
