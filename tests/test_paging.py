"""The paged KV cache: the block accounting (every block free, held or cached, none leaked, whatever the sequence of
requests and cancellations), prefix keys, eviction, and the runner's packed steps over block tables (rows of every
kind in one step equal to each alone; shared blocks; pools too small for all)."""

import random

import pytest
import torch

from helpers import MockStepModel, context_logits, decode_one, one
from lookahead import LookaheadConfig, Request
from lookahead.kernels import StepPattern
from lookahead.loop import Engine, RowStep, path_step
from lookahead.models import Llama
from lookahead.models.paging import BlockPool
from lookahead.models.runner import CachedRunner
from lookahead.request import SamplingParams


def test_blocks_are_free_held_or_cached_and_none_leak_under_random_use():
    """A property test: random admissions (with prefix matches), publications, releases and evictions."""
    rng = random.Random(0)
    pool = BlockPool(24, 4)
    texts = [[rng.randrange(3) for _ in range(16)] for _ in range(4)]  # few, alike: prefixes repeat
    held: list[tuple[list[int], list[int]]] = []  # (blocks, tokens) of live rows
    for _ in range(2000):
        action = rng.random()
        if action < 0.45:
            tokens = rng.choice(texts)[: rng.randrange(1, 17)]
            shared, ids = pool.match(tokens, len(tokens) - 1)
            assert len(shared) == len(ids) <= (len(tokens) - 1) // 4
            need = rng.randrange(len(shared), 8)
            if need - len(shared) > pool.available:
                pool.release(shared)
            else:
                blocks = shared + pool.allocate(need - len(shared))
                parent = ids[-1] if ids else -1
                for b in range(len(shared), min(need, len(tokens) // 4)):  # the row writes and keys its full blocks
                    parent = pool.publish(blocks[b], parent, tokens[4 * b : 4 * b + 4])
                held.append((blocks, tokens))
        elif held:
            blocks, _ = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
        pool.check()
        assert pool.held == len({b for blocks, _ in held for b in blocks})
    for blocks, _ in held:
        pool.release(blocks)
    pool.check()
    assert pool.held == 0 and pool.free + pool.cached == 24


def test_a_matched_prefix_is_held_by_both_and_cached_when_both_leave():
    pool = BlockPool(8, 4)
    first = pool.allocate(3)
    parent = pool.publish(first[0], -1, [1, 2, 3, 4])
    pool.publish(first[1], parent, [5, 6, 7, 8])
    shared, ids = pool.match([1, 2, 3, 4, 5, 6, 7, 8, 9], 8)
    assert shared == first[:2] and len(ids) == 2 and pool.refs[first[0]] == 2
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8], 7)[0] == [first[0]]  # never the block of the prompt's last token
    pool.release([first[0]])
    pool.release(first)
    pool.release(shared)
    pool.check()
    assert pool.cached == 2 and pool.free == 6
    # the least recently used cached block goes first when memory is needed; a row's blocks are freed last first, so
    # the prefix's second block goes before its first, and the first still matches
    assert pool.allocate(7)[-1] == first[1] and pool.cached == 1 and pool.match([1, 2, 3, 4, 5], 4)[0] == [first[0]]


def test_after_an_eviction_a_cached_prompt_still_matches_all_but_its_last_block():
    """A row of three keyed blocks released, then one block evicted: the prompt matches two of its three blocks
    (evicting the first block first made the rest unmatchable: 0 of 3)."""
    pool = BlockPool(4, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    blocks = pool.allocate(4)
    parent = -1
    for b in range(3):
        parent = pool.publish(blocks[b], parent, prompt[2 * b : 2 * b + 2])
    pool.release(blocks)
    assert pool.allocate(2) and pool.cached == 2  # the free block, then one cached one evicted
    assert len(pool.match(prompt, 6)[0]) == 2


def test_clearing_the_cache_forgets_every_key():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    pool.publish(blocks[0], -1, [1, 1])
    pool.release(blocks)
    pool.clear_cache()
    pool.check()
    assert pool.free == 4 and pool.match([1, 1, 1], 2) == ([], [])


@pytest.mark.parametrize("bad, message", [((0, 4), "num_blocks"), ((4, 0), "block_size"), ((2.0, 4), "num_blocks")])
def test_pool_sizes_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        BlockPool(*bad)


def full_logits(model: Llama, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]))[0]


def test_one_packed_step_of_every_kind_of_row_equals_each_row_alone(tiny_checkpoint):
    """A prompt chunk after a cached prefix, a first chunk, a plain step and a lookahead step with a tree, in one
    forward pass over shuffled blocks, each row's logits equal to a full forward of its own tokens."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, num_blocks=40, max_step_tokens=16, block_size=4, max_rows=4)
    runner.blocks._free = type(runner.blocks._free)(random.Random(1).sample(range(40), 40))  # scattered tables
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 101, (n,), generator=rng).tolist() for n in (13, 9, 6, 11)]
    rows = [runner.admit(p, 36)[0] for p in prompts]
    # rows 0, 2, 3 prefill first (row 1 waits), each in one chunk
    for row, prompt in zip([rows[0], rows[2], rows[3]], [prompts[0], prompts[2], prompts[3]], strict=True):
        runner.step([RowStep.chunk(row, prompt)])
        runner.commit(row, range(len(prompt)))
    tree = StepPattern(2, 3, tree_end=(3, 3, 3))  # W=2, N=3: 4 branch tokens, then a path of 3 nodes
    la_tokens = [prompts[3][-1], 5, 6, 7, 8, 9, 10]
    steps = [RowStep.chunk(rows[1], prompts[1][:5]), RowStep(rows[2], [prompts[2][-1]], path_step(1), [0]),
             RowStep(rows[3], la_tokens, tree, list(range(7)), topk=3),
             RowStep.chunk(rows[0], [1, 2, 3])]
    outputs = runner.step(steps)
    expected_chunk = full_logits(model, prompts[1][:5])[-1]
    assert (outputs[0].logits[0] - expected_chunk).abs().max() < 1e-4
    assert (outputs[1].logits[0] - full_logits(model, prompts[2] + [prompts[2][-1]])[-1]).abs().max() < 1e-4
    # the tree's nodes see the input token and their ancestors: node j is the path la_tokens[4 : 5 + j]
    for j in range(3):
        context = prompts[3] + [la_tokens[0]] + la_tokens[4 : 5 + j]
        assert (outputs[2].logits[4 + j] - full_logits(model, context)[-1]).abs().max() < 1e-4
    # level 1 column 1 sees level 0 columns 0, 1 and itself
    context = prompts[3] + [la_tokens[0], la_tokens[1], la_tokens[3]]
    assert (outputs[2].logits[3] - full_logits(model, context)[-1]).abs().max() < 1e-4
    assert outputs[2].topk.shape == (7, 3)
    assert (outputs[3].logits[0] - full_logits(model, prompts[0] + [1, 2, 3])[-1]).abs().max() < 1e-4


def test_a_pool_too_small_for_all_makes_requests_wait_then_answers_each_exactly(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, num_blocks=10, max_step_tokens=8, block_size=4, max_rows=8)
    engine = Engine(runner)
    rng = random.Random(2)
    prompts = [[rng.randrange(101) for _ in range(rng.randrange(3, 12))] for _ in range(5)]
    handles = [engine.submit(one(p, 10, lookahead=LookaheadConfig(2, 3, 2, warm=False))) for p in prompts]
    rows_seen = []
    while engine.step():
        rows_seen.append(len(engine.active))
        runner.blocks.check()
    assert max(rows_seen) < 5  # not all fit at once: some waited
    for prompt, handle in zip(prompts, handles, strict=True):
        assert handle.result().tokens == model.generate(prompt, max_new_tokens=10, eos_token_id=[]).tokens
    assert not runner.rows and runner.blocks.held == 0


def test_a_request_that_can_never_fit_is_refused_and_the_others_served(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, num_blocks=4, max_step_tokens=1, block_size=4, max_rows=2)
    engine = Engine(runner)
    big = engine.submit(one(list(range(30)), 4))
    small = engine.submit(one([1, 2, 3], 4))
    while engine.step():
        pass
    with pytest.raises(RuntimeError, match="blocks"):
        big.result()
    assert small.result().tokens == model.generate([1, 2, 3], max_new_tokens=4, eos_token_id=[]).tokens


def test_mock_engine_prefill_in_chunks_equals_one_prefill():
    vocab = 32
    fn = lambda ctx: context_logits(ctx, vocab)  # noqa: E731
    from helpers import MockRowModel

    prompt = [random.Random(3).randrange(vocab) for _ in range(40)]
    model = MockRowModel(vocab, fn, prefill_chunk=7)
    (result,) = Engine(model).run(Request([prompt], 12, lookahead=LookaheadConfig(2, 3, 2, warm=False)))
    assert result.tokens == decode_one(MockStepModel(vocab, fn), prompt, 12,
                                       lookahead=LookaheadConfig(2, 3, 2, warm=False)).tokens
    assert model.step_tokens[:6] == [7] * 5 + [5] and result.steps == len(model.step_tokens) - 5


def random_tree(size: int, rng: random.Random) -> tuple[int, ...]:
    """A random pre-order tree of `size` nodes under the input token, as tree_end."""
    parents = [-1] + [rng.randrange(-1, j) for j in range(1, size)]
    ends = list(range(1, size + 1))
    for j in reversed(range(size)):
        p = parents[j]
        while p >= 0 and ends[p] < ends[j]:
            ends[p] = ends[j]
            p = parents[p]
    try:
        StepPattern(1, 2, tree_end=tuple(ends))
        return tuple(ends)
    except ValueError:
        return tuple(range(1, size + 1))


@pytest.mark.parametrize("case", range(6), ids=lambda c: f"case{c}")
def test_the_torch_backend_equals_the_paged_reference(case):
    """The model's CPU attention over packed rows and block tables (random, shuffled, shared blocks, partial last
    blocks, trees, per-row L, W and N, plain rows, prompt chunks, GQA) against `paged_reference_attention`, which
    builds each row's mask independently with `StepPattern.materialize`."""
    from lookahead.kernels import paged_reference_attention
    from lookahead.models.attention import PackedStep, TorchBackend
    from lookahead.models.kv_cache import KVPool, KVShape

    rng = random.Random(case)
    gen = torch.Generator().manual_seed(case)
    heads_q, heads_kv, dim, size = rng.choice([(4, 4, 8), (4, 2, 16), (6, 2, 8)]) + (rng.choice([4, 16]),)
    pool = KVPool(KVShape(1, heads_kv, dim), 64, size, torch.float32, "cpu")
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    shared = rng.sample(range(64), 2)  # a prefix two rows share
    patterns, lengths, tables, starts, free = [], [], [], [], [b for b in range(64) if b not in shared]
    rng.shuffle(free)
    for row in range(rng.randrange(1, 6)):
        kind = rng.choice(["plain", "chunk", "tree", "window"])
        if kind == "plain":
            pattern = StepPattern(1, 2, 0)
        elif kind == "chunk":
            pattern = path_step(rng.randrange(2, 40))
        elif kind == "tree":
            pattern = StepPattern(1, 2, tree_end=random_tree(rng.randrange(1, 9), rng))
        else:
            w, n = rng.randrange(1, 4), rng.randrange(2, 5)
            pattern = StepPattern(w, n, tree_end=random_tree(rng.randrange(0, 7), rng))
        length = rng.randrange(0, 50)
        need = -(-(length + pattern.num_tokens) // size)
        table = (shared if row < 2 else []) + [free.pop() for _ in range(need)]
        patterns.append(pattern)
        lengths.append(length)
        tables.append(table[:max(need, 2 if row < 2 else 0)])
        starts.append(sum(p.num_tokens for p in patterns[:-1]))
    total = sum(p.num_tokens for p in patterns)
    q = torch.randn(1, heads_q, total, dim, generator=gen)
    step = PackedStep(lengths, patterns, tables, starts, size, total)
    out = TorchBackend(torch.device("cpu")).begin_step(step)(0, q, pool.k[0], pool.v[0])
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    tree_end = torch.tensor([e for p in patterns for e in [0] * p.lookahead_len + list(p.node_ends)])
    reference = paged_reference_attention(
        q[0].transpose(0, 1), pool.blocks(pool.k[0]), pool.blocks(pool.v[0]), block_table,
        torch.tensor([*starts, total]), torch.tensor(lengths), torch.tensor([p.window for p in patterns]),
        torch.tensor([p.ngram for p in patterns]), tree_end, upcast=True)
    torch.testing.assert_close(out[0].transpose(0, 1), reference, rtol=1e-5, atol=1e-5)


def test_requests_sharing_a_system_prompt_under_eviction_get_a_fresh_models_answers(tiny_checkpoint):
    """A pool too small to hold every request's blocks and every cached prefix: requests share a system prompt (its
    blocks held by several rows at once), wait for room, evict cached blocks, and sample with their own settings; each
    answer is a fresh model's, and no block leaks."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, num_blocks=20, max_step_tokens=8, block_size=4, max_rows=3)
    engine = Engine(runner)
    rng = random.Random(5)
    system = [rng.randrange(101) for _ in range(13)]
    specs = []
    for i in range(7):
        prompt = system + [rng.randrange(101) for _ in range(rng.randrange(1, 12))]
        specs.append((prompt, 0.0 if i % 2 else 0.9, 100 + i))
    handles = [engine.submit(one(p, 9, sampling=SamplingParams(t, top_p=0.9) if t else SamplingParams(), seed=s,
                             lookahead=LookaheadConfig(2, 3, 2, warm=False))) for p, t, s in specs]
    while engine.step():
        runner.blocks.check()
    shared = [h.result().cached_tokens for h in handles]
    assert max(shared) >= 12 and runner.blocks.held == 0
    for (prompt, temperature, seed), handle in zip(specs, handles, strict=True):
        expected = fresh.generate(prompt, max_new_tokens=9, temperature=temperature, top_p=0.9, seed=seed,
                                  eos_token_id=[])
        assert handle.result().tokens == expected.tokens


def test_no_block_leaks_whatever_is_cancelled_when(tiny_checkpoint):
    """A property test on the real runner: requests submitted and cancelled at random steps (waiting, prefilling,
    decoding); afterwards every block is free or cached, and the finished requests' answers are a fresh model's."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, num_blocks=24, max_step_tokens=8, block_size=4, max_rows=3)
    runner.prefill_chunk = 5
    engine = Engine(runner)
    rng = random.Random(11)
    handles, prompts = [], []
    for _ in range(60):
        if rng.random() < 0.3:
            prompts.append([rng.randrange(101) for _ in range(rng.randrange(1, 15))])
            handles.append(engine.submit(one(prompts[-1], rng.randrange(1, 10),
                                         lookahead=rng.choice([None, LookaheadConfig(2, 3, 2, warm=False)]))))
        if handles and rng.random() < 0.15:
            rng.choice(handles).cancel()
        engine.step()
        runner.blocks.check()
    while engine.step():
        runner.blocks.check()
    assert runner.blocks.held == 0 and not runner.rows
    reasons = [h.result().finish_reason for h in handles]
    assert "cancelled" in reasons and "length" in reasons
    for prompt, handle in zip(prompts, handles, strict=True):
        result = handle.result()
        expected = fresh.generate(prompt, max_new_tokens=10, eos_token_id=[]).tokens
        assert result.tokens == expected[: len(result.tokens)]
