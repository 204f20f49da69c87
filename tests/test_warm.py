"""Warm drafting: the drafting memory kept across generations changes drafts only, never tokens; it stays under its
cap, forgetting the oldest; warm=False neither reads nor writes it; a batch's rows never see each other's state; and
on repeated text it raises S."""

import copy

import pytest
import torch
from test_sampling import DEPTH, P_FLOOR, PROMPT, VOCAB, accept_first_path, distribution_p_values, exact_joint

import lookahead.drafts.memory as memory_module
import lookahead.loop.core as engine
from helpers import MockRowModel, MockStepModel, context_logits, decode_one, decode_rows
from lookahead import LookaheadConfig, SamplingParams
from lookahead.drafts import DraftMemory, NGramPool, RecycleTables
from lookahead.models import Llama

CFG = LookaheadConfig(2, 4, 4, budget="fixed")  # full-size steps: S and steps compared across generations
COLD = LookaheadConfig(2, 4, 4, budget="fixed", warm=False)
OTHERS = [[(7 * i + 3 * j) % 16 for j in range(12)] for i in range(1, 5)]  # prompts unlike each other


def filled(mock_vocab: int = 16, prompts=OTHERS, cap: int = 4096) -> DraftMemory:
    """A memory that warm generations of other prompts filled on the mock."""
    memory = DraftMemory(cap)
    for prompt in prompts:
        decode_one(MockStepModel(mock_vocab), prompt, 24, lookahead=CFG, memory=memory)
    assert memory.generations == len(prompts) and memory.tokens_held > 0
    return memory


def footprint(memory: DraftMemory) -> tuple:
    """Everything the memory holds, as sizes."""
    return (memory.generations, memory.tokens_held, memory.bytes_held, len(memory.recycle.triples),
            len(memory.recycle.pairs), len(memory.recycle.single), memory.suffix.keys, len(memory.suffix.tokens),
            sum(len(c) for c in memory._grams.values()))


@pytest.mark.parametrize("form", ["tree", "chains"])
def test_mock_warm_equals_plain_greedy_after_other_prompts(form):
    memory = filled()
    for seed in range(4):
        prompt = torch.randint(0, 16, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = decode_one(MockStepModel(16), prompt, 40)
        warm = decode_one(MockStepModel(16), prompt, 40, lookahead=LookaheadConfig(2, 4, 4, form=form),
                          memory=memory)
        assert warm.tokens == plain.tokens
    assert memory.generations == len(OTHERS) + (4 if form == "tree" else 0)  # chains drafts cold


def test_tiny_llama_warm_equals_plain_greedy_and_cold(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompts = [[3, 17, 22, 3, 17, 5, 9], [40, 41, 3, 17, 22], [8, 8, 9, 60, 61, 62, 63], [3, 17, 22, 3, 17, 5, 9]]
    for prompt in prompts:
        warm = model.generate(prompt, max_new_tokens=32, eos_token_id=[], lookahead=CFG)
        cold = fresh.generate(prompt, max_new_tokens=32, eos_token_id=[], lookahead=COLD)
        assert warm.tokens == cold.tokens == fresh.generate(prompt, max_new_tokens=32, eos_token_id=[]).tokens
    assert model.draft_memory.generations == len(prompts) and fresh.draft_memory.generations == 0
    model.generate(prompts[0], max_new_tokens=8, eos_token_id=[])  # plain decoding: no drafts to remember
    assert model.draft_memory.generations == len(prompts)


def sample_counts(memory, n, cfg):
    counts: dict = {}
    multi = 0
    for seed in range(n):
        result = decode_one(MockStepModel(VOCAB), PROMPT, DEPTH, SamplingParams(1.0), lookahead=cfg, seed=seed,
                            memory=memory)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        multi += any(len(s) > 1 for s in result.step_tokens)
    return counts, multi / n


def sampling_memory() -> DraftMemory:
    """Filled by other prompts over the same small vocabulary, sampled, so every context has remembered drafts."""
    memory = DraftMemory(512)
    for seed in range(8):
        other = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        decode_one(MockStepModel(VOCAB), other, 16, SamplingParams(1.0), lookahead=LookaheadConfig(3, 3, 3),
                   seed=seed, memory=memory)
    return memory


def test_warm_sampling_keeps_the_distribution():
    n = 2000
    joint = exact_joint(lambda ctx: context_logits(ctx, VOCAB), PROMPT, SamplingParams(1.0))
    counts, multi = sample_counts(sampling_memory(), n, LookaheadConfig(3, 3, 3))
    assert multi > 0.2, f"only {multi:.0%} of runs accepted a draft token"
    checks = distribution_p_values(counts, joint, n)
    assert min(checks.values()) > P_FLOOR, checks


def test_a_wrong_acceptance_rule_fails_the_warm_sampling_test(monkeypatch):
    """Negative control: accepting the tree's first path unchecked (remembered drafts included) is caught."""
    monkeypatch.setattr(engine, "verify", accept_first_path)
    n = 2000
    joint = exact_joint(lambda ctx: context_logits(ctx, VOCAB), PROMPT, SamplingParams(1.0))
    counts, _ = sample_counts(sampling_memory(), n, LookaheadConfig(3, 3, 3))
    assert distribution_p_values(counts, joint, n)["joint"] < P_FLOOR


def segment(i: int, length: int = 30) -> tuple[list[int], RecycleTables, NGramPool]:
    """A generation's text, recycling tables and pool, distinct per i."""
    text = [1000 * i + j for j in range(length)]
    recycle = RecycleTables()
    recycle.update([-1] * length, [-1] + text[:-1], text, [[t + 1] * 8 for t in text])
    pool = NGramPool(3, 4)
    pool.add_sequence(text)
    return text, recycle, pool


def test_the_cap_holds_and_the_oldest_is_forgotten():
    memory = DraftMemory(cap_tokens=100)
    for i in range(10):
        memory.add(*segment(i))
        assert memory.tokens_held <= memory.cap_tokens
    assert memory.generations == 3 and memory.tokens_held == 90
    kept = DraftMemory(cap_tokens=100)  # what the last three alone hold: forgetting freed everything else
    for i in range(7, 10):
        kept.add(*segment(i))
    assert footprint(memory) == footprint(kept) and memory.bytes_held == kept.bytes_held > 0
    old, new = segment(0)[0], segment(9)[0]
    assert memory.continuations(old[:3], 4, 5) == [] and memory.recycled(-1, old[2], old[3]) == (None, ())
    assert memory.candidates(old[0], 4) == []
    assert memory.continuations(new[:3], 4, 5) == [(tuple(new[3:8]), 3)]  # never past the text's end
    assert memory.continuations(new[-2:], 4, 5) == []
    assert memory.recycled(-1, new[2], new[3]) == ([new[3] + 1] * 8, ())
    assert memory.candidates(new[0], 4) == [tuple(new[1:3])]
    big = DraftMemory(cap_tokens=20)
    big.add(*segment(1, length=50))  # a text longer than the cap keeps its last cap_tokens
    assert big.tokens_held == 20 and big.continuations(segment(1, 50)[0][-8:-5], 4, 2)


def test_the_cap_is_checked_and_zero_keeps_nothing():
    with pytest.raises(ValueError, match="cap_tokens"):
        DraftMemory(cap_tokens=-1)
    memory = DraftMemory(cap_tokens=0)
    memory.add(*segment(0))
    assert footprint(memory) == footprint(DraftMemory())


def test_warm_false_neither_reads_nor_writes():
    memory = filled()
    before = footprint(memory)
    prompt = [3, 4, 5, 3, 4, 5, 6]
    off = decode_one(MockStepModel(16), prompt, 40, lookahead=COLD, memory=memory)
    assert footprint(memory) == before
    empty = decode_one(MockStepModel(16), prompt, 40, lookahead=CFG, memory=DraftMemory())
    assert off.step_tokens == empty.step_tokens == decode_one(MockStepModel(16), prompt, 40, lookahead=CFG).step_tokens
    rows = decode_rows(MockRowModel(16), [prompt, OTHERS[0]], 20, lookahead=COLD, memory=memory)
    assert footprint(memory) == before and rows[0].tokens == off.tokens[:20]


def test_a_prompt_after_others_gives_its_cold_tokens():
    memory = filled()
    target = [1, 2] + [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 4
    fn = lambda ctx: context_logits(ctx, 16, target=target)  # noqa: E731
    for prompt in (target[:6], OTHERS[1][:5]):
        warm = decode_one(MockStepModel(16, fn), prompt, 30, lookahead=CFG, memory=memory)
        assert warm.tokens == decode_one(MockStepModel(16, fn), prompt, 30, lookahead=COLD).tokens


def test_batch_rows_read_the_memory_as_it_was_and_are_added_at_the_end():
    """Each row equals its prompt alone (tokens), drafts from the memory as it was before the batch (steps equal to
    its prompt alone with a copy of that memory), and every row is remembered once the batch ends."""
    memory = filled()
    prompts = [OTHERS[0][:6], [5, 6, 5, 6, 5], OTHERS[2][:4]]
    alone = [decode_one(MockStepModel(16), p, 24, lookahead=CFG, static_step=True, memory=copy.deepcopy(memory))
             for p in prompts]
    before = memory.generations
    rows = decode_rows(MockRowModel(16), prompts, 24, lookahead=CFG, memory=memory)
    assert [r.tokens for r in rows] == [r.tokens for r in alone]
    assert [r.step_tokens for r in rows] == [r.step_tokens for r in alone]
    assert memory.generations == before + len(prompts)


def test_warm_raises_s_on_repeated_text(tiny_checkpoint):
    """The same prompt twice, then the same instruction over another input: S of the later generations is higher
    warm than cold (greedy S is deterministic)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    first, again = [3, 17, 22, 3, 17, 5, 9], [3, 17, 22, 3, 17, 5, 9]
    kwargs = dict(max_new_tokens=40, eos_token_id=[])
    model.generate(first, lookahead=CFG, **kwargs)
    warm = model.generate(again, lookahead=CFG, **kwargs)
    cold = model.generate(again, lookahead=COLD, **kwargs)
    assert warm.tokens == cold.tokens and warm.compression > cold.compression + 0.3, (warm.steps, cold.steps)
    memory = DraftMemory()
    target = [1, 2] + [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 4
    fn = lambda ctx: context_logits(ctx, 16, target=target)  # noqa: E731
    decode_one(MockStepModel(16, fn), target[:4], 40, lookahead=CFG, memory=memory)
    warm = decode_one(MockStepModel(16, fn), target[:5], 40, lookahead=CFG, memory=memory)
    cold = decode_one(MockStepModel(16, fn), target[:5], 40, lookahead=COLD)
    assert warm.tokens == cold.tokens and warm.compression > cold.compression + 0.3, (warm.steps, cold.steps)


def test_clear_empties_the_models_memory(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompt = [3, 17, 22, 3, 17, 5, 9]
    model.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=CFG)
    assert model.draft_memory.tokens_held > 0 and model.draft_memory.bytes_held > 0
    model.draft_memory.clear()
    assert footprint(model.draft_memory) == footprint(DraftMemory())
    again = model.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=CFG)
    assert again.step_tokens == fresh.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=CFG).step_tokens


def test_a_warmup_remembers_nothing(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.warmup(CFG, max_tokens=64)
    assert model.draft_memory.generations == 0


# ---- pinned by hand mutation (issue 28 item 10) ---------------------------------------------------------------------


def test_forgetting_a_generation_keeps_what_a_later_one_wrote_under_the_same_key():
    """Per-key forgetting: the oldest generation goes past the cap, but a recycled row or an n-gram that a later one
    wrote under the same key is the later one's, and stays."""
    memory = DraftMemory(cap_tokens=40)
    for row in ([1] * 8, [2] * 8):  # the same context (7, 8), a row each; the same n-gram 5 -> (6, 7) each
        recycle = RecycleTables()
        recycle.update([-1], [7], [8], [row])
        pool = NGramPool(3, 4)
        pool.add_sequence([5, 6, 7])
        memory.add(list(range(30)), recycle, pool)
    assert memory.generations == 1  # 60 tokens past a cap of 40: the first is forgotten
    assert memory.recycled(-1, 7, 8) == ([2] * 8, ())
    assert memory.candidates(5, 4) == [(6, 7)]


def test_the_memory_keeps_eight_continuations_per_first_token():
    memory = DraftMemory()
    pool = NGramPool(2, 20)  # the generation's own pool keeps more than the memory does
    pool.add_sequence([5, 10, 5, 11, 5, 12, 5, 13, 5, 14, 5, 15, 5, 16, 5, 17, 5, 18, 5, 19])
    memory.add([5, 10], RecycleTables(), pool)
    assert memory_module.POOL_PER_KEY == 8
    assert memory.candidates(5, 20) == [(c,) for c in range(19, 11, -1)]  # the 8 most recent, most recent first
