"""The Triton lookahead attention against the SDPA reference, its input checks, and the KV commit."""

import pytest
import torch

from lookahead.kernels import StepPattern, commit_accepted, interpreting, lookahead_attention, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# allowed error on top of 2x eager's (FlagAttention's rule); fp32 leaves room for TF32 in the reference on GPU
FLOOR = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    interpreting(), reason="the Triton interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584); GPU only"))]


def make_step(W, N, g, prefix_len, dtype, batch=1, heads_q=4, heads_kv=2, head_dim=64, slack=5, seed=0):
    """Random q [B, Hq, T, D] (a transposed view, as the model passes it) and k, v with `slack` spare positions."""
    gen = torch.Generator().manual_seed(seed)
    t = StepPattern(W, N, g).num_tokens
    q = torch.randn(batch, t, heads_q, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, heads_kv, prefix_len + t + slack, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(batch, heads_kv, prefix_len + t + slack, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v


def check_against_reference(q, k, v, prefix_len, W, N, g):
    out = lookahead_attention(q, k, v, prefix_len, W, N, g)
    ref = reference_attention(q, k, v, prefix_len, W, N, g, upcast=True)
    eager = reference_attention(q, k, v, prefix_len, W, N, g, upcast=False)
    assert out.dtype == q.dtype and out.shape == q.shape
    budget = 2 * (eager.float() - ref.float()).abs().max().item() + FLOOR[q.dtype]
    error = (out.float() - ref.float()).abs().max().item()
    assert error <= budget, f"max error {error:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("W, N, g", [(1, 2, 0), (5, 4, 0), (5, 4, 2), (5, 4, 5), (3, 3, 3), (15, 5, 15), (7, 2, 7)],
                         ids=lambda v: None)
@pytest.mark.parametrize("prefix_len", [0, 70], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference(W, N, g, prefix_len, dtype):
    check_against_reference(*make_step(W, N, g, prefix_len, dtype), prefix_len, W, N, g)


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128], ids=lambda d: f"D{d}")
def test_kernel_head_layouts(heads_q, heads_kv, head_dim):
    W, N, g, prefix_len = 4, 3, 2, 33
    q, k, v = make_step(W, N, g, prefix_len, torch.float32, batch=2, heads_q=heads_q, heads_kv=heads_kv,
                        head_dim=head_dim)
    check_against_reference(q, k, v, prefix_len, W, N, g)


@pytest.mark.parametrize("prefix_len", [1, 63, 64, 65, 200], ids=lambda n: f"L{n}")
def test_kernel_prefix_lengths_around_block_edges(prefix_len):
    check_against_reference(*make_step(5, 4, 3, prefix_len, torch.float16, batch=2), prefix_len, 5, 4, 3)


def test_kernel_builds_no_mask(monkeypatch):
    q, k, v = make_step(5, 4, 2, 20, torch.float32)

    def forbidden(*args, **kwargs):
        raise AssertionError("a dense mask was built on the kernel path")

    monkeypatch.setattr(StepPattern, "materialize", forbidden)
    lookahead_attention(q, k, v, 20, 5, 4, 2)


@pytest.mark.parametrize("case, error, message", [
    (dict(q_3d=True), ValueError, "must be 4-D"),
    (dict(guesses=3), ValueError, r"needs \(W \+ g\) \* \(N - 1\)"),
    (dict(heads_kv=4), ValueError, "multiple of KV heads"),
    (dict(prefix_len=-1), ValueError, "prefix_len must be an int >= 0"),
    (dict(prefix_len=100), ValueError, "k/v hold"),
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(ngram=1), ValueError, "ngram must be >= 2"),
    (dict(guesses=-1), ValueError, "guesses must be >= 0"),
    (dict(k_dtype=torch.float16), TypeError, "must share a dtype"),
    (dict(int_q=True), TypeError, "unsupported dtype"),
])
def test_kernel_input_checks(case, error, message):
    q, k, v = make_step(5, 4, 2, 10, torch.float32, heads_q=6, heads_kv=2)
    if case.get("q_3d"):
        q = q[0]
    if "heads_kv" in case:
        k = v = torch.zeros(1, case["heads_kv"], 40, 64, device=DEVICE)
    if "k_dtype" in case:
        k = k.to(case["k_dtype"])
    if case.get("int_q"):
        q, k, v = q.int(), k.int(), v.int()
    args = dict(prefix_len=10, window=5, ngram=4, guesses=2)
    args.update({key: case[key] for key in ("prefix_len", "window", "ngram", "guesses") if key in case})
    with pytest.raises(error, match=message):
        lookahead_attention(q, k, v, **args)


@pytest.mark.skipif(interpreting() is False and not torch.cuda.is_available(), reason="needs Triton")
def test_kernel_refuses_cpu_tensors_outside_interpreter(monkeypatch):
    import lookahead.kernels.triton_attention as module

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


def test_kernel_compiles_for_hopper_and_ampere():
    """No GPU needed: Triton compiles the kernel for sm_90 and sm_80, so GPU-only lowering errors show here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" OK ") == 4, run.stdout
