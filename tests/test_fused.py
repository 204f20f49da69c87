"""The fused elementwise kernels (CPU: Triton's interpreter) against their torch references: the 2x rule against fp32,
and the torch ops at the same dtype to the last rounding; odd sizes, [T] and [B, T] positions, in-place writes."""

from __future__ import annotations

import pytest
import torch

from helpers import needs_triton
from lookahead.kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    rotary_,
    rotary_reference,
    silu_mul,
    silu_mul_reference,
)

DTYPES = [torch.float32, torch.float16]  # bf16 too on a GPU
if torch.cuda.is_available():
    DTYPES.append(torch.bfloat16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_triton  # kernels on DEVICE: the GPU where there is one, else the interpreter
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
ULPS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # one rounding of the largest values here


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def check(got, ref, eager, dtype):
    """FlagAttention's rule against the fp32 reference, and near-equality with the same-dtype torch ops."""
    budget = 2 * (eager.float() - ref.float()).abs().max().item() + FLOOR[dtype]
    assert (got.float() - ref.float()).abs().max().item() <= budget
    scale = max(1.0, eager.float().abs().max().item())
    assert (got.float() - eager.float()).abs().max().item() <= ULPS[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 5, 576), (3, 37)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("first", [True, False], ids=["no-residual", "residual"])
def test_add_rms_norm(dtype, shape, first):
    x = randn(*shape, dtype=dtype)
    weight = 1 + 0.1 * randn(shape[-1], dtype=dtype, seed=1)
    residual = None if first else randn(*shape, dtype=dtype, seed=2)
    before = None if first else residual.clone()
    ref, ref_h = add_rms_norm_reference(x, weight, 1e-5, before, upcast=True)
    eager, eager_h = add_rms_norm_reference(x, weight, 1e-5, before)
    out, h = add_rms_norm(x, weight, 1e-5, residual)
    check(out, ref, eager, dtype)
    assert torch.equal(h, eager_h)  # the residual stream rounds exactly as torch's add
    if first:
        assert h is x
    else:
        assert h is residual  # updated in place


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [(3, 64), (5, 6)], ids=["smollm-ish", "odd"])
@pytest.mark.parametrize("per_row", [False, True], ids=["pos-T", "pos-BT"])
def test_rotary_in_place_on_views_of_a_merged_projection(dtype, heads, head_dim, per_row):
    b, t, hkv = 2, 7, 1 if heads == 3 else 5
    qkv = randn(b, t, (heads + 2 * hkv) * head_dim, dtype=dtype).view(b, t, heads + 2 * hkv, head_dim)
    q, k, v = qkv.split((heads, hkv, hkv), dim=2)
    positions = torch.arange(3, 3 + t) if not per_row else torch.tensor([[0, 1, 2, 3, 4, 5, 6], [900] * 2 + [7] * 5])
    positions = positions.to(DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(DEVICE)
    ref = rotary_reference(q, k, positions, inv_freq, upcast=True)
    eager = rotary_reference(q, k, positions, inv_freq)
    v_before = v.clone()
    got = rotary_(q, k, positions, inv_freq)
    assert got[0] is q and got[1] is k
    for g, r, e in zip(got, ref, eager, strict=True):
        check(g, r, e, dtype)
    assert torch.equal(v, v_before)  # the value heads between and after are untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 192), (2, 3, 3072), (5, 2200)], ids=lambda s: "x".join(map(str, s)))
def test_silu_mul(dtype, shape):
    gate_up = randn(*shape, dtype=dtype) * 3
    check(silu_mul(gate_up), silu_mul_reference(gate_up, upcast=True), silu_mul_reference(gate_up), dtype)


def test_bad_inputs_are_refused_with_the_shapes():
    x = randn(2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[8\]"):
        add_rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, randn(2, 9, dtype=torch.float32))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        silu_mul(torch.ones(2, 4, dtype=torch.int32, device=DEVICE))
    q, k = randn(1, 3, 2, 8, dtype=torch.float32), randn(1, 3, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_(q, k, torch.arange(4, device=DEVICE), torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="inv_freq must be a contiguous fp32"):
        rotary_(q, k, torch.arange(3, device=DEVICE), torch.ones(8, device=DEVICE))


def test_operands_on_another_device_or_strided_are_refused():
    """The kernels read weight, inv_freq and positions through raw pointers: a wrong device or stride is an error,
    not an illegal memory access."""
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(x, torch.ones(16, device=DEVICE)[::2], 1e-6)
    with pytest.raises(ValueError, match="is on meta"):
        add_rms_norm(x, torch.ones(8, device="meta"), 1e-6)
    q, k = torch.randn(1, 3, 2, 8, device=DEVICE), torch.randn(1, 3, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="positions is on meta"):
        rotary_(q, k, torch.arange(3, device="meta"), torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous fp32"):
        rotary_(q, k, torch.arange(3, device=DEVICE), torch.ones(8, device=DEVICE)[::2])
