"""Tree-form verification: the tree, its packing and verification, the draft sources, and exactness against plain
greedy over tree shapes and sources, static and exact-size, on the mock model, a tiny LLaMA and the kernel."""

import random

import numpy as np
import pytest
import torch
from test_pattern import TREES

from helpers import MockStepModel, context_logits, decode_one, grow_from, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.drafts import EMPTY, ROOT, DraftBuilder, DraftMemory, DraftTree, NGramPool, RecycleTables, SuffixIndex
from lookahead.drafts.builder import Sources
from lookahead.drafts.edges import suffix_state
from lookahead.drafts.suffix import SEPARATOR
from lookahead.kernels import StepPattern
from lookahead.loop import full_pattern, pack_step
from lookahead.loop.verify import Verdict, verify
from lookahead.models import Llama

SOURCES = ("pool", "suffix", "recycle")
SOURCE_SETS = [frozenset(s for i, s in enumerate(SOURCES) if mask >> i & 1) for mask in range(8)]
SOURCE_IDS = ["+".join(sorted(s)) or "none" for s in SOURCE_SETS]
TARGET = [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 6  # each token determines the next


def tree_config(W, N, G, sources=SOURCES, **kwargs):
    """Full-size steps (these tests count steps and shapes; self-tuned sizes are tests/test_tuning.py's)."""
    kwargs.setdefault("budget", "fixed")
    return LookaheadConfig(W, N, G, form="tree", **{f"draft_{s}": s in sources for s in SOURCES}, **kwargs)


def depths(tree: DraftTree) -> list[int]:
    return [len(tree.path(j)) for j in range(len(tree))]


def test_draft_tree_from_parents():
    tree = DraftTree.from_parents([5, 6, 7, 8, 9], [ROOT, 0, 1, 0, ROOT])
    assert tree.tree_end == [4, 3, 3, 4, 5]
    assert list(tree.children(ROOT)) == [0, 4] and list(tree.children(0)) == [1, 3] and list(tree.children(2)) == []
    assert tree.path(2) == [0, 1, 2] and tree.path(ROOT) == [] and depths(tree) == [1, 2, 3, 2, 1]
    assert StepPattern(2, 3, tree_end=tree.tree_end).relative_positions.tolist()[4:] == depths(tree)
    with pytest.raises(ValueError, match="not a pre-order forest"):
        DraftTree.from_parents([1, 2, 3], [ROOT, ROOT, 0])


def test_suffix_index_longest_match_first_then_most_recent():
    index = SuffixIndex(max_match=3)
    index.extend([1, 2, 3, 9, 2, 3, 8, 5, 2, 3])
    # "2 3" ends at 2 and 5 (a 3-gram "x 2 3" matches nowhere: the tokens before differ)
    assert index.continuations(5, 2) == [((8, 5), 2), ((9, 2), 2)]
    index.extend([4])  # "3 4" never occurred: back off to "4", never seen either
    assert index.continuations(5, 2) == []
    index.extend([1, 2])  # "4 1 2" no, "1 2" at 1: continuation (3, 9); then "2" alone adds nothing new
    assert index.continuations(5, 2)[0] == ((3, 9), 2)
    assert index.continuations(1, 3) == [((3, 9, 2), 2)]


def test_suffix_index_measures_a_long_match_beyond_what_it_indexes():
    copied = list(range(100, 112))
    # the suffix copied[:10] ends the sequence; its last 3 tokens occurred twice: long ago inside `copied` (a match of
    # 10 tokens, measured to reach 8) and just before it after another token (a match of 3)
    sequence = [*copied, 60, 61, 62, copied[7], copied[8], copied[9], 77, 78, 63, *copied[:10]]
    index = SuffixIndex(max_match=3, reach=8)
    index.extend(sequence)
    assert index.continuations(5, 2) == [((copied[10], copied[11]), 8), ((77, 78), 3)]  # longest first
    short = SuffixIndex(max_match=3)  # reach defaults to what is indexed: most recent first
    short.extend(sequence)
    assert short.continuations(5, 2) == [((77, 78), 3), ((copied[10], copied[11]), 3)]
    # an occurrence at the very start is measured back to its first token, never around the end
    edge = SuffixIndex(max_match=3, reach=8)
    edge.extend([5, 6, 7, 8, 9, 8, 5, 6, 7, 8])
    assert edge.continuations(1, 1) == [((9,), 4)]
    # a text boundary stops it (the drafting memory's texts), as the tail given runs out
    held = SuffixIndex(max_match=3, reach=8)
    held.extend([1, 2, 3, 4, 5, SEPARATOR, 6, 7, 8, 9])
    assert held.continuations(1, 1, tail=[4, 5, 6, 7, 8]) == [((9,), 3)]
    held.extend([SEPARATOR, 3, 4, 5, 6, 7, 8, 10])
    assert held.continuations(1, 1, tail=[4, 5, 6, 7, 8]) == [((10,), 5)]
    assert held.continuations(1, 1, tail=[5, 6, 7, 8]) == [((10,), 4)]


def suffix_chain_depth(matched: int, budget: int = 15, remembered: bool = False) -> int:
    """How deep the best tree of `budget` nodes follows a text being copied, `matched` tokens into the copy, when
    the recycled lists offer 8 other tokens under every node; the text earlier in this sequence, or (`remembered`)
    in the drafting memory only, an earlier generation's."""
    text = list(range(100, 140))
    copy = [300, 301, 302, 999, *text[10 : 10 + matched]]  # 999: the match is exactly `matched` long
    memory = None
    if remembered:
        memory = DraftMemory()
        memory.add(text, RecycleTables(), None)
    sequence = copy if remembered else [*text, *copy]
    builder = DraftBuilder(sequence, Sources(pool=False), memory=memory)
    known = sorted(set(sequence) | set(text))
    builder.recycle.update([-1] * len(known), [-1] * len(known), known, np.array([list(range(500, 508))] * len(known)))
    tree = builder.build(sequence, NGramPool(4, 5), budget)
    copied, node = text[10 + matched :], ROOT
    for depth, token in enumerate(copied):
        below = [child for child in tree.children(node) if tree.tokens[child] == token]
        if not below:
            return depth
        node = below[0]
    return len(copied)


def test_suffix_states_change_at_the_match_bands_and_keep_first_later_and_memory_apart():
    for later in (False, True):
        for memory in (False, True):
            states = [suffix_state(m, later, memory) for m in range(1, 40)]
            assert [m for m in range(2, 40) if states[m - 1] != states[m - 2]] == [2, 4, 8, 16]
    kinds = [{suffix_state(m, later, memory) for m in range(1, 40)}
             for later in (False, True) for memory in (False, True)]
    assert sum(map(len, kinds)) == len(set().union(*kinds)) == 20


def test_a_long_exact_match_puts_the_budget_on_its_chain():
    # what SuffixDecoding does with a long match, and the spread tree did not: one deep chain; a short match shares
    depths_by_match = [suffix_chain_depth(m) for m in (1, 2, 8, 16)]
    assert depths_by_match == sorted(depths_by_match)
    assert depths_by_match[-1] >= 10 and depths_by_match[1] <= 4


def test_a_match_in_the_drafting_memory_is_measured_as_far_back(monkeypatch):
    # an earlier generation's text: the builder looks it up with the sequence's last 16 tokens, not the 4 indexed
    # (the match lengths the builder scores the memory's continuations by)
    seen = []
    look_up = DraftMemory.continuations

    def recording(self, tail, limit, length):
        found = look_up(self, tail, limit, length)
        seen.extend(match for _, match in found)
        return found

    monkeypatch.setattr(DraftMemory, "continuations", recording)
    for matched in (2, 16):
        seen.clear()
        suffix_chain_depth(matched, remembered=True)
        assert max(seen) == matched


def test_recycle_tables_longest_context_first_last_row_wins():
    tables = RecycleTables()
    assert tables.lookup(0, 0, 5) == (None, ())
    topk = np.array([[1, 2], [3, 4], [5, 6]])
    tables.update([0, 0, 0], [9, 8, 9], [5, 5, 7], topk)
    assert tables.lookup(0, 9, 5) == ([1, 2], ()) and tables.lookup(0, 8, 5) == ([3, 4], ())
    assert tables.lookup(0, 0, 5) == (None, [3, 4])  # no such pair: the token's last row
    assert tables.lookup(0, 0, 7) == (None, [5, 6]) and tables.lookup(0, 0, 6) == (None, ())
    tables.update([3], [9], [5], np.array([[7, 8]]))  # the same pair after another token: a triple of its own
    assert tables.lookup(3, 9, 5) == ([7, 8], ()) and tables.lookup(0, 9, 5) == ([1, 2], ())
    assert tables.lookup(4, 9, 5) == ([7, 8], ())  # an unseen triple falls back to the pair (its last row)


@pytest.mark.parametrize("budget", [0, 1, 5, 12, 60])
def test_builder_grows_a_trie_within_budget(budget):
    rng = random.Random(budget)
    sequence = [rng.randrange(12) for _ in range(80)]
    builder = DraftBuilder(sequence)
    pool = NGramPool(4, 5)
    pool.add_sequence(sequence)
    for _ in range(5):  # recycled predictions under every token and pair
        tokens = [rng.randrange(12) for _ in range(20)]
        before = [[rng.randrange(12) for _ in tokens] for _ in range(2)]
        builder.recycle.update(*before, tokens, np.array([rng.sample(range(12), 8) for _ in tokens]))
    tree = builder.build(sequence, pool, budget)
    assert len(tree) == budget  # every source has plenty: the budget is filled
    assert StepPattern(1, 2, tree_end=tree.tree_end).num_tokens == 1 + budget  # a valid pre-order forest
    assert tree == DraftTree.from_parents(tree.tokens, tree.parents)
    for node in [ROOT, *range(len(tree))]:
        siblings = [tree.tokens[c] for c in tree.children(node)]
        assert len(siblings) == len(set(siblings))  # a trie


def test_static_tree_layout_pads_with_invisible_leaves():
    cfg = tree_config(3, 4, 2)  # budget 6 nodes
    full = full_pattern(cfg)
    assert full.num_tokens == 15 and full.max_commit == 7
    levels = [[10, 11, 12], [20, 21, 22]]  # warm-up: 2 of 3 levels
    tree = DraftTree.from_parents([5, 6, 7], [ROOT, 0, ROOT])
    layout = pack_step(levels, tree, full, static=True)
    assert layout.pattern.shape == full.shape and layout.tokens[9:12] == [5, 6, 7]
    assert layout.pattern.tree_end == (11 - 9, 11 - 9, 3, 4, 5, 6)
    assert len(layout.rows) == 1 + 3 + 6 and list(layout.node_indices) == [9, 10, 11]
    padding = [6, 7, 8, 12, 13, 14]
    real = [i for i in range(15) if i not in padding]
    assert not layout.pattern.materialize(0)[real][:, padding].any()  # no real token sees a padding token
    assert layout.commit_indices(Verdict([6, 7, 1], 1)) == [0, 9, 10]
    assert layout.commit_indices(Verdict([4], ROOT)) == [0]
    assert layout.parents[:6] == [-1, 0, 1, 0, 1, 2] and layout.parents[9:12] == [0, 9, 0]
    assert layout.slot_rows == [0, 4, 5, 6] and layout.row_depths == [0, 1, 2, 3, 1, 2, 1, 1, 1, 1]
    assert [layout.index_of_slot(s) for s in range(4)] == [0, 9, 10, 11]
    assert [layout.slot_of_index(i) for i in (0, 9, 10, 11)] == [0, 1, 2, 3]
    exact = pack_step(levels, tree, full, static=False)
    assert exact.pattern == StepPattern(3, 3, tree_end=(2, 2, 3)) and exact.tokens == [10, 11, 12, 20, 21, 22, 5, 6, 7]
    assert exact.commit_indices(Verdict([6, 7, 1], 1)) == [0, 6, 7]
    with pytest.raises(ValueError, match="does not fit"):
        pack_step(levels, DraftTree.from_parents(list(range(7)), [ROOT] * 7), full, static=True)


def test_verify_takes_the_matching_path():
    tree = DraftTree.from_parents([5, 6, 7, 8, 6], [ROOT, 0, 1, 0, ROOT])
    argmax = [5, 8, 7, 1, 2, 3]  # by slot: the input token, then node j at slot 1 + j
    verdict = verify(tree, argmax)
    assert verdict.tokens == [5, 8, 2] and verdict.node == 3 and verdict.run == 2
    assert verify(tree, [9, *argmax[1:]]).tokens == [9]
    assert verify(EMPTY, [4]).tokens == [4]


class ShapeDrafts:
    """Replaces the draft sources by one fixed tree shape whose tokens are mostly plain greedy's next tokens (so
    paths are accepted deep) and sometimes a wrong one (so verification stops inside the tree)."""

    def __init__(self, parents, prompt, reference, vocab, seed=0):
        self.parents, self.offset, self.reference, self.vocab = parents, len(prompt), reference, vocab
        self.rng = random.Random(seed)

    def build(self, sequence, pool, budget):  # the tree `grow_from` turns into DraftBuilder.grow
        assert len(self.parents) <= budget
        done = len(sequence) - self.offset  # tokens generated so far: the input token is reference[done - 1]
        tokens, depth = [], []
        for parent in self.parents:
            depth.append(1 if parent == ROOT else depth[parent] + 1)
            truth = self.reference[done - 1 + depth[-1]] if done - 1 + depth[-1] < len(self.reference) else 0
            tokens.append(truth if self.rng.random() < 0.75 else self.rng.randrange(self.vocab))
        return DraftTree.from_parents(tokens, self.parents)


SHAPES = ["empty", "single-path", "star", "deep-chain", "padding-leaves", "branchy", "random4"]


@pytest.mark.parametrize("static", [False, True], ids=["exact-size", "static"])
@pytest.mark.parametrize("shape", SHAPES)
def test_mock_tree_shapes_equal_greedy(monkeypatch, shape, static):
    vocab = 16
    for seed in range(3):
        prompt = torch.randint(0, vocab, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = decode_one(MockStepModel(vocab), prompt, 40)
        drafts = ShapeDrafts(TREES[shape], prompt, plain.tokens, vocab, seed)
        monkeypatch.setattr(DraftBuilder, "grow", grow_from(drafts.build))
        model = MockStepModel(vocab)
        result = decode_one(model, prompt, 40, lookahead=tree_config(3, 5, 4), static_step=static)
        assert result.tokens == plain.tokens and result.steps == model.calls
        deepest, depth = max(len(s) for s in result.step_tokens), max(depths(DraftTree.from_parents(
            TREES[shape], TREES[shape])), default=0)
        assert deepest == 1 + depth if shape in ("empty", "star") else deepest > 2  # paths accepted deep
        shapes = {p.shape for p in model.patterns}
        assert len(shapes) == 1 if static else len(shapes) > 1


@pytest.mark.parametrize("shape", ["empty", "star", "deep-chain", "padding-leaves", "branchy"])
def test_tiny_llama_tree_shapes_equal_greedy(tiny_checkpoint, monkeypatch, shape):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompt = [3, 17, 22, 3, 17, 5, 9]
    plain = model.generate(prompt, max_new_tokens=40, eos_token_id=[])
    monkeypatch.setattr(DraftBuilder, "grow", grow_from(ShapeDrafts(TREES[shape], prompt, plain.tokens, 101).build))
    for static in (False, True):
        result = model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=tree_config(3, 5, 4),
                                static_step=static)
        assert result.tokens == plain.tokens
        assert (result.steps < 30) == (shape != "empty")


@pytest.mark.parametrize("static", [False, True], ids=["exact-size", "static"])
@pytest.mark.parametrize("sources", SOURCE_SETS, ids=SOURCE_IDS)
def test_mock_sources_on_off_equal_greedy(sources, static):
    for W, N, G in [(3, 4, 3), (1, 2, 5), (5, 3, 4)]:
        for seed in range(2):
            prompt = torch.randint(0, 16, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            plain = decode_one(MockStepModel(16), prompt, 40)
            result = decode_one(MockStepModel(16), prompt, 40, lookahead=tree_config(W, N, G, sources),
                            static_step=static)
            assert result.tokens == plain.tokens


@pytest.mark.parametrize("sources", SOURCE_SETS, ids=SOURCE_IDS)
def test_tiny_llama_sources_on_off_equal_greedy(tiny_checkpoint, sources):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompt = [3, 17, 22, 3, 17, 5, 9, 3, 17]
    plain = model.generate(prompt, max_new_tokens=40, eos_token_id=[])
    for static in (False, True):
        result = model.generate(prompt, max_new_tokens=40, eos_token_id=[], static_step=static,
                                lookahead=tree_config(3, 4, 3, sources))
        assert result.tokens == plain.tokens


# S of the mock model that knows TARGET with each source alone at W3-N4-G3 (measured: pool 2.40, suffix 3.16,
# recycle 2.73; all three 3.33); a disconnected source gives 1.0
FLOORS = {"pool": 1.8, "suffix": 2.5, "recycle": 2.2}


@pytest.mark.parametrize("source", [None, *SOURCES], ids=["none", *SOURCES])
def test_every_source_feeds_the_tree(source):
    """With every source off the tree stays empty and S is exactly 1; each source alone must lift S above its floor,
    so a source that is silently cut off (not queried, not fed, its table never filled) fails here."""
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    plain = decode_one(MockStepModel(vocab, fn), [1, 2], 60)
    for static in (False, True):
        cfg = tree_config(3, 4, 3, () if source is None else (source,))
        result = decode_one(MockStepModel(vocab, fn), [1, 2], 60, lookahead=cfg, static_step=static)
        assert result.tokens == plain.tokens
        if source is None:
            assert result.compression == 1.0
        else:
            assert result.compression > FLOORS[source], result.compression


@needs_interpreter
def test_triton_backend_tree_steps(tiny_checkpoint):
    """The kernel with a per-step tree (tree_end as data) inside the decode loop, under the interpreter on CPU."""
    folder = tiny_checkpoint("gqa")
    reference = Llama.from_pretrained(folder, attn_backend="torch")
    kernel = Llama.from_pretrained(folder, attn_backend="triton")
    prompt = [3, 17, 22, 3, 17, 5, 9, 3, 17]
    plain = reference.generate(prompt, max_new_tokens=16, eos_token_id=[])
    result = kernel.generate(prompt, max_new_tokens=16, eos_token_id=[], lookahead=tree_config(2, 3, 3),
                             static_step=True)
    assert result.tokens == plain.tokens and result.steps < 16


def test_static_tree_generation_has_one_shape(tiny_checkpoint):
    """Trees change every step, the step's shape does not: one runner program (one CUDA graph on a GPU)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = tree_config(7, 5, 7)
    result = model.generate(list(range(3, 40)) * 2, max_new_tokens=40, eos_token_id=[], lookahead=cfg,
                            static_step=True)
    runner = model.runner
    padded = runner.round_up(full_pattern(cfg).num_tokens)
    assert result.steps < 40 and [shape.tokens for shape in runner.step_shapes] == [padded]
    mock = MockStepModel(16)
    decode_one(mock, [1, 2, 3, 1, 2], 40, lookahead=cfg, static_step=True)
    assert len({p.shape for p in mock.patterns}) == 1 and len({p.tree_end for p in mock.patterns}) > 1


def order2_text(vocab: int, seed: int):
    """A model of an order-2 text: the next token is a fixed function of the two before it (peaked logits), so a
    token's successor depends on the token before it too."""
    rng = random.Random(seed)
    table = {(a, b): rng.randrange(vocab) for a in range(vocab) for b in range(vocab)}

    def logits(context):
        out = context_logits(context[-3:], vocab)
        out[table[(context[-2], context[-1])]] += 30.0
        return out

    return logits


def test_recycled_top_k_is_kept_under_each_rows_own_context():
    """Every row's top-k is recorded under that row's own previous tokens (its ancestors in the step), not the input
    token's: on an order-2 text the pair and triple tables then hold what follows each context. Keying every row by
    the input token's context still decodes exactly, but drafts the wrong successors, and S falls under the floor."""
    vocab = 16
    cfg = LookaheadConfig(1, 4, 5, draft_pool=False, draft_suffix=False)  # recycling alone feeds the tree
    rates = []
    for seed in range(6):
        fn = order2_text(vocab, seed)
        result = decode_one(MockStepModel(vocab, fn), [1, 2, 3], 120, lookahead=cfg)
        assert result.tokens == decode_one(MockStepModel(vocab, fn), [1, 2, 3], 120).tokens
        rates.append(result.compression)
    assert sum(rates) / len(rates) > 3.5, rates
