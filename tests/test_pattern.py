"""The step layout and attention pattern: DESIGN.md's rules, the paper's example, torch == Triton."""

import pytest
import torch
import triton
import triton.language as tl

from lookahead.kernels import StepPattern, lookahead_mask
from lookahead.kernels.triton_attention import _visible

CASES = [(1, 2, 0), (1, 2, 3), (5, 4, 2), (3, 3, 0), (4, 5, 3), (15, 5, 15), (2, 6, 1)]
IDS = [f"W{w}-N{n}-G{g}" for w, n, g in CASES]


def rule_from_design(W, N, g):
    """DESIGN.md's table and rules, written as sets: {step index: (part, position, visible step indices)}."""
    parts = {}
    for level in range(N - 1):
        for col in range(W):
            parts[W * level + col] = ("look", level, col)
    for c in range(g):
        for k in range(1, N):
            parts[W * (N - 1) + c * (N - 1) + k - 1] = ("cand", c, k)
    visible = {}
    for q, (kind, a, b) in parts.items():
        if kind == "look":
            level, col = a, b
            seen = {p for p in range(col + 1)}  # level 0 columns 0..col
            seen |= {W * lv + col for lv in range(1, level + 1)}  # own column, levels 1..level
        else:
            c, k = a, b
            seen = {0} | {W * (N - 1) + c * (N - 1) + j - 1 for j in range(1, k + 1)}
        visible[q] = seen
    return visible


@pytest.mark.parametrize("W, N, g", CASES, ids=IDS)
def test_mask_follows_design_rules(W, N, g):
    mask = lookahead_mask(W, N, g, prefix_len=0)
    expected = rule_from_design(W, N, g)
    assert mask.shape == (len(expected), len(expected))
    for q, seen in expected.items():
        assert set(mask[q].nonzero().flatten().tolist()) == seen, f"row {q}"


@pytest.mark.parametrize("prefix_len", [0, 1, 37], ids=lambda n: f"L{n}")
def test_mask_prefix_is_fully_visible(prefix_len):
    mask = lookahead_mask(5, 4, 2, prefix_len)
    assert mask.shape == (21, prefix_len + 21)
    assert mask[:, :prefix_len].all()


def test_paper_example_w5_n4_g2():
    """Fig. 2(b): the red token at relative position 6 (level 2, column 4) sees positions 0-6 of its own
    branch (blue 0, orange 1-4, green 5, itself) and nothing of the two candidates."""
    p = StepPattern(5, 4, 2)
    red6 = p.level_index(2, 4)
    assert p.relative_positions[red6] == 6
    mask = lookahead_mask(5, 4, 2, prefix_len=0)
    seen = mask[red6].nonzero().flatten().tolist()
    assert seen == [0, 1, 2, 3, 4, p.level_index(1, 4), red6]
    assert sorted(p.relative_positions[seen].tolist()) == list(range(7))
    assert not mask[red6, p.lookahead_len :].any()
    # candidate 1 token 3 sees the input and its own tokens 1..3, not candidate 0 nor the lookahead branch
    last = p.candidate_index(1, 3)
    assert mask[last].nonzero().flatten().tolist() == [0, p.candidate_index(1, 1), p.candidate_index(1, 2), last]


@pytest.mark.parametrize("W, N, g", CASES, ids=IDS)
def test_relative_positions_follow_design_table(W, N, g):
    p = StepPattern(W, N, g)
    pos = p.relative_positions.tolist()
    assert len(pos) == (W + g) * (N - 1) == p.num_tokens
    for level in range(N - 1):
        for col in range(W):
            assert pos[p.level_index(level, col)] == level + col
    for c in range(g):
        for k in range(1, N):
            assert pos[p.candidate_index(c, k)] == k


@triton.jit
def _mask_tile_kernel(Out, T: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    vis = _visible(offs[:, None], offs[None, :], W, N)
    ok = (offs[:, None] < T) & (offs[None, :] < T)
    tl.store(Out + offs[:, None] * T + offs[None, :], vis.to(tl.int8), mask=ok)


@pytest.mark.parametrize("W, N, g", CASES, ids=IDS)
def test_triton_predicate_equals_torch_predicate(W, N, g):
    p = StepPattern(W, N, g)
    t = p.num_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(t, t, dtype=torch.int8, device=device)
    _mask_tile_kernel[(1,)](out, T=t, BLOCK=triton.next_power_of_2(t), W=W, N=N)
    assert torch.equal(out.bool().cpu(), p.materialize(0))


@pytest.mark.parametrize("bad, message", [
    (dict(window=0, ngram=2, guesses=0), "window must be >= 1"),
    (dict(window=1, ngram=1, guesses=0), "ngram must be >= 2"),
    (dict(window=1, ngram=2, guesses=-1), "guesses must be >= 0"),
    (dict(window=1.0, ngram=2, guesses=0), "window must be an int"),
])
def test_pattern_rejects_bad_parameters(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        StepPattern(**bad)
