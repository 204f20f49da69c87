"""The paged KV cache: the block accounting (every block free, held or cached, none leaked, whatever the sequence of
requests and cancellations), prefix keys, eviction, and the runner's packed steps over block tables (rows of every
kind in one step equal to each alone; shared blocks; pools too small for all)."""

import random

import pytest
import torch

from helpers import MockStepModel, context_logits, decode_one
from lookahead import LookaheadConfig, Request
from lookahead.loop import Engine, RowStep, path_step
from lookahead.models import Llama
from lookahead.models.paging import BlockPool
from lookahead.models.runner import CachedRunner


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
    # the least recently used cached block goes first when memory is needed
    assert pool.allocate(7)[-1] == first[0] and pool.cached == 1 and pool.match([1, 2, 3, 4, 5], 4)[0] == []


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
    pattern = LookaheadConfig(2, 3, 2)
    from lookahead.kernels import StepPattern

    tree = StepPattern(2, 3, tree_end=(3, 3, 3))  # W=2, N=3: 4 branch tokens, then a path of 3 nodes
    la_tokens = [prompts[3][-1], 5, 6, 7, 8, 9, 10]
    steps = [RowStep.chunk(rows[1], prompts[1][:5]), RowStep(rows[2], [prompts[2][-1]], path_step(1), [0]),
             RowStep(rows[3], la_tokens, tree, list(range(7)), topk=3),
             RowStep.chunk(rows[0], [1, 2, 3])]
    outputs = runner.step(steps)
    assert pattern  # the configuration the tree's shape comes from
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
    handles = [engine.submit(p, 10, lookahead=LookaheadConfig(2, 3, 2, warm=False)) for p in prompts]
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
    big = engine.submit(list(range(30)), 4)
    small = engine.submit([1, 2, 3], 4)
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
