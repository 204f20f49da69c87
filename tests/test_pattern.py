"""The step layout and attention pattern: docs/DESIGN.md's rules (chains and trees), the paper's example,
torch == Triton."""

import random

import pytest
import torch
import triton
import triton.language as tl

from helpers import needs_triton
from lookahead.kernels import StepPattern, lookahead_mask
from lookahead.kernels.attention_kernels import _visible

CASES = [(1, 2, 0), (1, 2, 3), (5, 4, 2), (3, 3, 0), (4, 5, 3), (15, 5, 15), (2, 6, 1)]
IDS = [f"W{w}-N{n}-G{g}" for w, n, g in CASES]


def rule_from_design(W, N, g):
    """docs/DESIGN.md's table and rules, written as sets: {step index: (part, position, visible step indices)}."""
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


def random_parents(size, rng):
    """A random forest of `size` nodes in pre-order, as parent indices (-1: a child of the input token)."""
    parents, path = [], []  # path: the ancestors of the last node, itself included
    for j in range(size):
        depth = rng.randint(0, len(path))
        parents.append(path[depth - 1] if depth else -1)
        path = path[:depth] + [j]
    return parents


def tree_end_of(parents):
    """docs/DESIGN.md's encoding: one past the pre-order index of the last node of each subtree."""
    ends = [j + 1 for j in range(len(parents))]
    for j in range(len(parents)):
        a = parents[j]
        while a >= 0:
            ends[a] = max(ends[a], j + 1)
            a = parents[a]
    return ends


def ancestors(parents, j):
    out = {j}
    while parents[j] >= 0:
        j = parents[j]
        out.add(j)
    return out


def tree_rule_from_design(W, N, parents):
    """The lookahead rows of the chains rule, and node q sees the input token and its ancestors and itself."""
    LA = W * (N - 1)
    visible = {q: seen for q, seen in rule_from_design(W, N, 0).items()}
    for j in range(len(parents)):
        visible[LA + j] = {0} | {LA + a for a in ancestors(parents, j)}
    return visible


TREES = {
    "empty": [],
    "single-path": [-1, 0, 1, 2, 3],
    "star": [-1] * 6,
    "deep-chain": list(range(-1, 15)),
    "padding-leaves": [-1, 0, 0, -1, 3, -1, -1, -1],
    "branchy": [-1, 0, 1, 1, 0, 4, -1, 6, 6],
}
TREES.update({f"random{i}": random_parents(1 + 3 * i, random.Random(i)) for i in range(6)})
TREE_CASES = [(W, N, name) for (W, N) in [(1, 2), (3, 4), (5, 3)] for name in TREES]
TREE_IDS = [f"W{w}-N{n}-{name}" for w, n, name in TREE_CASES]


def chain_tree(N, g):
    return tuple((j // (N - 1) + 1) * (N - 1) for j in range(g * (N - 1)))


@pytest.mark.parametrize("W, N, name", TREE_CASES, ids=TREE_IDS)
def test_tree_mask_follows_design_rules(W, N, name):
    parents = TREES[name]
    p = StepPattern(W, N, tree_end=tree_end_of(parents))
    expected = tree_rule_from_design(W, N, parents)
    mask = p.materialize(0)
    assert mask.shape == (len(expected), len(expected)) == (p.num_tokens, p.num_tokens)
    for q, seen in expected.items():
        assert set(mask[q].nonzero().flatten().tolist()) == seen, f"row {q}"
    depths = [len(ancestors(parents, j)) for j in range(len(parents))]
    assert p.relative_positions.tolist()[p.lookahead_len :] == depths
    assert p.max_commit == 1 + max(depths, default=0)


@pytest.mark.parametrize("W, N, g", CASES, ids=IDS)
def test_chains_equal_their_tree(W, N, g):
    chains, tree = StepPattern(W, N, g), StepPattern(W, N, tree_end=chain_tree(N, g))
    assert torch.equal(chains.materialize(3), tree.materialize(3))
    assert torch.equal(chains.relative_positions, tree.relative_positions)
    assert chains.num_tokens == tree.num_tokens and chains.max_commit == tree.max_commit
    assert torch.equal(lookahead_mask(W, N, g, 2), lookahead_mask(W, N, 99, 2, tree_end=chain_tree(N, g)))


@pytest.mark.parametrize("W, N, g, expected", [(1, 2, 0, 1), (3, 4, 0, 1), (3, 4, 3, 4), (15, 5, 15, 5), (7, 2, 7, 2)],
                         ids=lambda v: None)
def test_max_commit_chains(W, N, g, expected):
    assert StepPattern(W, N, g).max_commit == expected


@triton.jit
def _mask_tile_kernel(Out, TreeEnd, Window, Ngram, T, BLOCK: tl.constexpr):
    """The kernel's predicate with W and N read from memory (run-time values, as every row of a packed call has its
    own), over one T x T tile."""
    W = tl.load(Window)
    N = tl.load(Ngram)
    LA = W * (N - 1)
    offs = tl.arange(0, BLOCK)
    k_end = LA + tl.load(TreeEnd + offs - LA, mask=(offs >= LA) & (offs < T), other=0)
    vis = _visible(offs[:, None], offs[None, :], k_end[None, :], W, N)
    ok = (offs[:, None] < T) & (offs[None, :] < T)
    tl.store(Out + offs[:, None] * T + offs[None, :], vis.to(tl.int8), mask=ok)


@triton.jit
def _mask_tile_kernel_constexpr(Out, TreeEnd, T, BLOCK: tl.constexpr, W: tl.constexpr, N: tl.constexpr):
    """The same predicate with W and N as compile-time constants (the one `_visible` serves both)."""
    LA: tl.constexpr = W * (N - 1)
    offs = tl.arange(0, BLOCK)
    k_end = LA + tl.load(TreeEnd + offs - LA, mask=(offs >= LA) & (offs < T), other=0)
    vis = _visible(offs[:, None], offs[None, :], k_end[None, :], W, N)
    ok = (offs[:, None] < T) & (offs[None, :] < T)
    tl.store(Out + offs[:, None] * T + offs[None, :], vis.to(tl.int8), mask=ok)


def triton_mask(p, constexpr=False):
    """The Triton predicate's T x T mask of pattern p; chains go in as their tree, as the kernel reads them."""
    t = p.num_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(t, t, dtype=torch.int8, device=device)
    ends = p.tree_end if p.is_tree else chain_tree(p.ngram, p.candidates)
    tree = torch.tensor(ends or (0,), dtype=torch.int64, device=device)
    block = max(16, triton.next_power_of_2(t))
    if constexpr:
        _mask_tile_kernel_constexpr[(1,)](out, tree, t, BLOCK=block, W=p.window, N=p.ngram)
    else:
        params = [torch.tensor([x], dtype=torch.int32, device=device) for x in (p.window, p.ngram)]
        _mask_tile_kernel[(1,)](out, tree, *params, t, BLOCK=block)
    return out.bool().cpu()


@needs_triton
@pytest.mark.parametrize("W, N, g", CASES, ids=IDS)
def test_triton_predicate_equals_torch_predicate(W, N, g):
    p = StepPattern(W, N, g)
    assert torch.equal(triton_mask(p), p.materialize(0))
    assert torch.equal(triton_mask(p, constexpr=True), p.materialize(0))
    as_tree = StepPattern(W, N, tree_end=chain_tree(N, g))  # chains written as trees: the same pattern
    assert torch.equal(triton_mask(as_tree), p.materialize(0))


@needs_triton
@pytest.mark.parametrize("W, N, name", TREE_CASES, ids=TREE_IDS)
def test_triton_tree_predicate_equals_torch_predicate(W, N, name):
    p = StepPattern(W, N, tree_end=tree_end_of(TREES[name]))
    assert torch.equal(triton_mask(p), p.materialize(0))


def test_predicates_are_written_line_for_line_alike():
    """The torch rule and the Triton predicate: the same statements, in the same order, after their headers."""
    import inspect

    from lookahead.kernels.pattern import _visible_rule

    def body(source):
        lines = [line.strip() for line in source.splitlines()]
        start = next(i for i, line in enumerate(lines) if line.startswith("LA ="))
        return [line for line in lines[start:] if line and not line.startswith("#")]

    assert body(inspect.getsource(_visible_rule)) == body(inspect.getsource(_visible.fn))


@pytest.mark.parametrize("bad, message", [
    (dict(window=0, ngram=2, candidates=0), "window must be >= 1"),
    (dict(window=1, ngram=1, candidates=0), "ngram must be >= 2"),
    (dict(window=1, ngram=2, candidates=-1), "candidates must be >= 0"),
    (dict(window=1.0, ngram=2, candidates=0), "window must be an int"),
    (dict(window=1, ngram=2, tree_end=(1, 1)), r"tree_end\[1\] must be in \(1, 2\]"),
    (dict(window=1, ngram=2, tree_end=(0,)), r"tree_end\[0\] must be in \(0, 1\]"),
    (dict(window=1, ngram=2, tree_end=(2, 3, 3)), "leaves its parent's subtree"),
    (dict(window=1, ngram=2, tree_end=(1.5,)), "tree_end must hold ints"),
    (dict(window=1, ngram=2, tree_end="ab"), "tree_end must be a sequence"),
])
def test_pattern_rejects_bad_parameters(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        StepPattern(**bad)


def test_tree_pattern_normalises_lists_and_has_no_candidate_index():
    p = StepPattern(2, 3, tree_end=[2, 2, 3])
    assert p.tree_end == (2, 2, 3) and hash(p) == hash(StepPattern(2, 3, tree_end=(2, 2, 3)))
    assert p.num_tokens == 2 * 2 + 3
    with pytest.raises(ValueError, match="chains form"):
        p.candidate_index(0, 1)
