"""Lookahead decoding with temperature 0 gives plain greedy's tokens exactly; pool, window, verifier units."""

import random

import pytest
import torch

from helpers import MockStepModel, context_logits, decode_one, flat_cost, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.drafts import ROOT, NGramPool, chain_trie
from lookahead.loop.verify import verify
from lookahead.loop.window import LookaheadWindow
from lookahead.models import Llama

CONFIGS = [(1, 2, 0), (1, 2, 3), (3, 2, 3), (4, 3, 0), (3, 3, 3), (5, 4, 5), (2, 5, 12), (7, 5, 7), (15, 5, 15)]
IDS = [f"W{w}-N{n}-G{g}" for w, n, g in CONFIGS]
TARGET = [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 6  # each token determines the next


@pytest.mark.parametrize("W, N, G", CONFIGS, ids=IDS)
def test_mock_model_lookahead_equals_greedy(W, N, G):
    """The mock rebuilds each token's context from the pattern, so a wrong layout or commit changes tokens."""
    for seed in range(4):
        prompt = torch.randint(0, 16, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = decode_one(MockStepModel(16), prompt, 40)
        model = MockStepModel(16)
        result = decode_one(model, prompt, 40, lookahead=LookaheadConfig(W, N, G))
        assert result.tokens == plain.tokens
        assert result.steps == model.calls


@pytest.mark.parametrize("form", ["chains", "tree"])
@pytest.mark.parametrize("W, N, G", [(5, 4, 5), (3, 3, 3), (1, 2, 1)], ids=["W5-N4-G5", "W3-N3-G3", "W1-N2-G1"])
def test_model_that_knows_a_text_accepts_many_tokens(W, N, G, form):
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    plain = decode_one(MockStepModel(vocab, fn), [1, 2], 60)
    assert plain.tokens[:40] == TARGET[:40]
    result = decode_one(MockStepModel(vocab, fn), [1, 2], 60, lookahead=LookaheadConfig(W, N, G, form=form))
    assert result.tokens == plain.tokens
    assert result.compression > 1 + 0.4 * (N - 1), result.compression
    longest = max(len(s) for s in result.step_tokens)
    if form == "chains":
        assert longest == N  # a whole candidate plus the model's own next token
    else:  # a path through the tree may be longer than an n-gram, up to the node budget
        assert longest > N if G * (N - 1) > N - 1 else longest == N


@pytest.mark.parametrize("form", ["chains", "tree"])
@pytest.mark.parametrize("W, N, G", [(5, 4, 5), (3, 3, 3), (1, 2, 1)], ids=["W5-N4-G5", "W3-N3-G3", "W1-N2-G1"])
def test_lookahead_branch_alone_feeds_the_pool(W, N, G, form):
    """With the prompt and output n-grams off (and the tree's other sources), every draft must come from the lookahead
    branch's columns: a pool cut off from that branch stays empty and S is exactly 1, so S > 1.3 proves the branch
    reaches it."""
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    plain = decode_one(MockStepModel(vocab, fn), [1, 2], 60)
    cfg = LookaheadConfig(W, N, G, pool_from_prompt=False, pool_from_output=False, form=form, draft_suffix=False,
                          draft_recycle=False)
    result = decode_one(MockStepModel(vocab, fn), [1, 2], 60, lookahead=cfg)
    assert result.tokens == plain.tokens
    assert result.compression > 1.3, result.compression


@pytest.mark.parametrize("W, N, G", CONFIGS, ids=IDS)
def test_tiny_llama_lookahead_equals_greedy(tiny_checkpoint, W, N, G):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.cost_model = flat_cost()  # self-tuned steps sized alike on any machine (a CUDA host times the CPU's steps)
    total_tokens = total_steps = 0
    for seed in range(3):
        prompt = torch.randint(0, 101, (3 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = model.generate(prompt, max_new_tokens=48, eos_token_id=[])
        result = model.generate(prompt, max_new_tokens=48, eos_token_id=[], lookahead=LookaheadConfig(W, N, G))
        assert result.tokens == plain.tokens, f"seed {seed}"
        total_tokens, total_steps = total_tokens + len(result.tokens), total_steps + result.steps
    if G > 0 and N > 2:
        assert total_tokens / total_steps > 1.3  # random tiny models repeat themselves: multi-token steps happen


@needs_interpreter
@pytest.mark.parametrize("W, N, G", [(1, 2, 0), (5, 4, 5), (3, 3, 3)], ids=["W1-N2-G0", "W5-N4-G5", "W3-N3-G3"])
def test_triton_backend_in_the_decode_loop(tiny_checkpoint, W, N, G):
    """The kernel inside the decode loop: exact against plain greedy of the torch backend."""
    folder = tiny_checkpoint("gqa")
    reference = Llama.from_pretrained(folder, attn_backend="torch")
    kernel = Llama.from_pretrained(folder, attn_backend="triton")
    prompt = [3, 17, 22, 3, 17, 5, 9]
    plain = reference.generate(prompt, max_new_tokens=24, eos_token_id=[])
    result = kernel.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=LookaheadConfig(W, N, G))
    assert result.tokens == plain.tokens


def test_eos_inside_an_accepted_ngram_stops_there():
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    eos = 12
    plain = decode_one(MockStepModel(vocab, fn), [1, 2], 60, stop=[eos])
    assert plain.tokens == TARGET[: TARGET.index(eos) + 1]
    streamed = []
    result = decode_one(MockStepModel(vocab, fn), [1, 2] + TARGET[:6], 60, stop=[eos],
                    lookahead=LookaheadConfig(4, 4, 4), stream=streamed.append)
    expected = TARGET[6:][: TARGET[6:].index(eos) + 1]
    assert result.tokens == expected
    assert [t for group in streamed for t in group] == expected
    assert len(result.step_tokens[-1]) > 1  # the EOS arrived inside a multi-token step


@pytest.mark.parametrize("limit", [1, 2, 5, 9, 13])
def test_max_new_tokens_is_exact_inside_an_ngram(limit):
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    result = decode_one(MockStepModel(vocab, fn), [1, 2] + TARGET[:8], limit, lookahead=LookaheadConfig(4, 5, 4))
    assert result.tokens == TARGET[8 : 8 + limit]


def test_prompt_shorter_than_window():
    plain = decode_one(MockStepModel(16), [3], 30)
    result = decode_one(MockStepModel(16), [3], 30, lookahead=LookaheadConfig(15, 5, 15))
    assert result.tokens == plain.tokens


def test_steps_count_every_forward_pass_including_prefill():
    model = MockStepModel(16)
    result = decode_one(model, [1, 2, 3], 25, lookahead=LookaheadConfig(3, 3, 3))
    assert result.steps == model.calls == len(result.step_tokens)
    assert sum(len(s) for s in result.step_tokens) == len(result.tokens) == 25


def test_warm_up_grows_the_window_one_level_per_step():
    model = MockStepModel(16)
    decode_one(model, [1, 2, 3, 4], 12, lookahead=LookaheadConfig(4, 5, 0))
    assert [p.ngram for p in model.patterns[:4]] == [2, 3, 4, 5]


def test_pool_keeps_most_recent_without_duplicates():
    pool = NGramPool(3, capacity=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # re-adding makes it the most recent
    assert pool.candidates(1, 5) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over capacity: the oldest, (4, 5), leaves
    assert pool.candidates(1, 5) == [(6, 7), (2, 3)]
    assert pool.candidates(1, 1) == [(6, 7)]
    assert pool.candidates(9, 5) == []
    pool.add_sequence([8, 9, 8, 9, 8])
    assert pool.candidates(8, 5) == [(9, 8)] and pool.candidates(9, 5) == [(8, 9)]
    with pytest.raises(ValueError, match="expected a 3-gram"):
        pool.add([1, 2])
    empty = NGramPool(3, capacity=0)
    empty.add([1, 2, 3])
    assert len(empty) == 0


def test_window_trajectory_update():
    window = LookaheadWindow(3, 4, input_token=10, fill_tokens=[50])
    assert window.levels == [[10, 50, 50]]
    window.advance([21, 22, 23], input_token=11)  # warm-up: levels shift one column, outputs become level 1
    assert window.levels == [[11, 50, 50], [22, 23, 50]]
    window.advance([31, 32, 33], input_token=12)
    assert window.levels == [[12, 50, 50], [23, 50, 50], [32, 33, 50]] and window.full
    assert window.columns([41, 42, 43]) == [[12, 23, 32, 41], [50, 50, 33, 42], [50, 50, 50, 43]]
    window.advance([41, 42, 43], input_token=13)  # full: the oldest level leaves, no shift
    assert window.levels == [[13, 50, 50], [32, 33, 50], [41, 42, 43]]


def _paper_greedy(candidates, argmax_after):
    """The paper's Algorithm 3 over separate candidates: the longest prefix equal to the model's argmax (the first
    candidate holding it), then the argmax after it. argmax_after(prefix) -> the argmax after input + prefix."""
    best = ()
    for candidate in candidates:
        run = 0
        while run < len(candidate) and candidate[run] == argmax_after(tuple(candidate[:run])):
            run += 1
        if run > len(best):
            best = tuple(candidate[:run])
    return [*best, argmax_after(best)]


def _paths(tree):
    """Each slot's prefix: () for the input token, node j's path tokens for slot 1 + j."""
    return [()] + [tuple(tree.tokens[n] for n in tree.path(j)) for j in range(len(tree))]


@pytest.mark.parametrize("seed", range(40))
def test_chains_as_a_trie_accept_what_the_papers_candidates_accept(seed):
    """The chains form drafts the pool's candidates as a trie; walking the trie must accept exactly what the paper's
    Algorithm 3 accepts over the separate candidates (sampling walks the same way, with seeded winners for argmax)."""
    rng = random.Random(seed)
    vocab, span = 4, rng.randint(1, 4)  # a small vocabulary: candidates share prefixes and tokens often
    candidates = [tuple(rng.randrange(vocab) for _ in range(span)) for _ in range(rng.randint(0, 6))]
    table = {}

    def argmax_after(prefix):  # a model: the argmax after each context, fixed per context
        return table.setdefault(prefix, rng.randrange(vocab))

    tree = chain_trie(candidates)
    assert len(tree) == len({c[:k] for c in candidates for k in range(1, span + 1)})  # shared prefixes stored once
    paths = _paths(tree)
    verdict = verify(tree, [argmax_after(path) for path in paths])
    assert verdict.tokens == _paper_greedy(candidates, argmax_after)
    assert verdict.node == ROOT or paths[verdict.node + 1] == tuple(verdict.tokens[:-1])



@pytest.mark.parametrize("kwargs, message", [
    (dict(window=0), "window must be >= 1"),
    (dict(ngram=1), "ngram must be >= 2"),
    (dict(guesses=-2), "guesses must be >= 0"),
    (dict(window=2.5), "window must be an int"),
    (dict(pool_from_prompt=1), "pool_from_prompt must be a bool"),
    (dict(draft_recycle=None), "draft_recycle must be a bool"),
    (dict(form="trie"), "form must be one of tree, chains, got 'trie'"),
])
def test_config_validation(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LookaheadConfig(**kwargs)
