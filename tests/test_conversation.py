"""Cached prefixes: a prompt that begins with full blocks of tokens whose entries the cache holds (a conversation's
earlier turns, a shared system prompt, another row of a batch) takes them instead of prefilling them, and decodes
exactly what a fresh model decodes from the whole prompt."""

import pytest
import torch

from helpers import fixed, one
from lookahead import LookaheadConfig
from lookahead.models import Llama
from lookahead.models.runner import BLOCK_SIZE

TURN1 = [17, 72, 97, 8, 32, 15, 63, 97, 57, 60]  # a prompt the tiny model does not answer with one token repeated
SYSTEM = [(7 * i + 3) % 101 for i in range(40)]  # a "system prompt" of 2.5 blocks


def fed_widths(model, monkeypatch) -> list[int]:
    """The token count of every forward pass the model runs from now on (the first of a generation: its prefill)."""
    widths: list[int] = []
    forward = type(model).forward

    def counting(self, input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    return widths


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("budget", ["fixed", "auto"])
def test_a_second_turn_prefills_only_the_new_tokens_and_equals_a_fresh_model(tiny_checkpoint, monkeypatch, budget):
    """Both budgets: with fixed steps the first turn's last step accepts draft tokens whose entries still wait for the
    deferred commit, which must land before the next turn reads them."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = LookaheadConfig(2, 3, 3, budget=budget, warm=False)
    for limit in range(30, 60):
        first = model.generate(TURN1, max_new_tokens=limit, lookahead=cfg, eos_token_id=[])
        if budget == "auto" or len(first.step_tokens[-1]) > 1:
            break
    assert len(set(first.tokens)) > 3 and (budget == "auto" or len(first.step_tokens[-1]) > 1)
    turn2 = TURN1 + first.tokens + [40, 41, 42]  # the answer, then the next message
    widths = fed_widths(model, monkeypatch)
    second = model.generate(turn2, max_new_tokens=16, lookahead=cfg, eos_token_id=[])
    # every token but the answer's last was fed, so its entry exists: the full blocks of that much are taken
    known = len(TURN1) + len(first.tokens) - 1
    assert second.cached_tokens == known // BLOCK_SIZE * BLOCK_SIZE > 0
    assert widths[0] == len(turn2) - second.cached_tokens
    monkeypatch.undo()
    assert second.tokens == fresh.generate(turn2, max_new_tokens=16, lookahead=cfg, eos_token_id=[]).tokens


def test_prompts_that_diverge_mid_block_share_the_full_blocks_before(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    first = model.generate(SYSTEM + [1, 2, 3], max_new_tokens=8, eos_token_id=[])
    assert first.cached_tokens == 0
    other = SYSTEM[:37] + [60, 61, 62, 63]  # diverges inside the third block
    second = model.generate(other, max_new_tokens=8, eos_token_id=[], lookahead=fixed(2, 3, 2))
    assert second.cached_tokens == 32
    assert second.tokens == fresh.generate(other, max_new_tokens=8, eos_token_id=[]).tokens
    # the whole prompt cached but its last token, whose logits are needed: that block runs again
    again = model.generate(SYSTEM[:32], max_new_tokens=4, eos_token_id=[])
    assert again.cached_tokens == 16


def test_rows_of_a_batch_leave_their_prefixes_for_later_requests(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    batch = model.generate([SYSTEM + [5], TURN1 * 3], max_new_tokens=6, eos_token_id=[], seed=3, temperature=0.8)
    assert [r.cached_tokens for r in batch] == [0, 0]
    later = [SYSTEM + [9, 9], TURN1 * 3 + [4]]
    results = model.generate(later, max_new_tokens=10, eos_token_id=[], seed=[5, 6], temperature=0.9, top_p=0.9)
    assert [r.cached_tokens for r in results] == [32, 16]
    expected = fresh.generate(later, max_new_tokens=10, eos_token_id=[], seed=[5, 6], temperature=0.9, top_p=0.9)
    assert [r.tokens for r in results] == [r.tokens for r in expected]


def test_weights_changed_in_place_drop_the_cached_prefixes(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    other = Llama.from_pretrained(tiny_checkpoint("gqa", seed=1))
    model.generate(SYSTEM, max_new_tokens=4, eos_token_id=[])
    with torch.no_grad():
        model.load_state_dict(other.state_dict())  # in place: no release(), no new parameters
    result = model.generate(SYSTEM + [1], max_new_tokens=12, eos_token_id=[])
    assert result.cached_tokens == 0
    assert result.tokens == other.generate(SYSTEM + [1], max_new_tokens=12, eos_token_id=[]).tokens


def test_measuring_the_cost_model_keeps_the_cached_prefixes(tiny_checkpoint):
    """The timed passes run on scratch rows whose placeholder entries are never keyed."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.generate(SYSTEM, max_new_tokens=4, eos_token_id=[])
    model.cost_model = None
    model.warmup(LookaheadConfig(2, 3, 2), max_tokens=64, sampling=True)
    assert model.generate(SYSTEM + [1], max_new_tokens=4, eos_token_id=[]).cached_tokens == 32


def test_a_block_filled_exactly_by_a_commit_is_keyed_at_once(tiny_checkpoint):
    """Issue 28 item 10: a prompt of exactly two blocks, and an answer of the prefill's token alone: both blocks are
    full when the row leaves, so a next prompt that begins with them takes both."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompt = list(range(1, 2 * BLOCK_SIZE + 1))
    assert model.generate(prompt, max_new_tokens=1, eos_token_id=[]).cached_tokens == 0
    assert model.generate(prompt + [40], max_new_tokens=1, eos_token_id=[]).cached_tokens == 2 * BLOCK_SIZE


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_prefix_cache_can_be_switched_off(tiny_checkpoint, prefix_cache):
    """`engine_for(prefix_cache=False)` (the server's --no-prefix-cache): every prompt prefills whole, same tokens."""
    from lookahead.models import engine_for

    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    engine = engine_for(model, max_batch=2, lookahead=None, prefix_cache=prefix_cache, kv_cache_bytes=2**22)
    first = engine.submit(one(SYSTEM, 4))
    while engine.step():
        pass
    second = engine.submit(one(SYSTEM + [1, 2], 6))
    while engine.step():
        pass
    assert first.result().cached_tokens == 0
    assert second.result().cached_tokens == (32 if prefix_cache else 0)
    assert second.result().tokens == model.generate(SYSTEM + [1, 2], max_new_tokens=6, eos_token_id=[]).tokens
