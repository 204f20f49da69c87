"""A conversation's next turn resumes from the cache: a prompt that begins with the last generation's prompt and
output prefills only what follows, and decodes exactly what a fresh model decodes from the whole history."""

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.models import Llama

TURN1 = [17, 72, 97, 8, 32, 15, 63, 97, 57, 60]  # a prompt the tiny model does not answer with one token repeated


def fed_widths(model, monkeypatch) -> list[int]:
    """The token count of every forward pass the model runs from now on (the first of a generation: its prefill)."""
    widths: list[int] = []
    forward = type(model).forward

    def counting(self, input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    return widths


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_second_turn_prefills_only_the_new_tokens_and_equals_a_fresh_model(tiny_checkpoint, monkeypatch, backend):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend=backend)
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = LookaheadConfig(2, 3, 3)
    # a first turn whose last step accepted draft tokens: their entries still wait for the deferred commit, which
    # must land before the next turn resumes from them
    for limit in range(12, 40):
        first = model.generate(TURN1, max_new_tokens=limit, lookahead=cfg, eos_token_id=[])
        if len(first.step_tokens[-1]) > 1:
            break
    assert len(first.step_tokens[-1]) > 1 and len(set(first.tokens)) > 3
    turn2 = TURN1 + first.tokens + [40, 41, 42]  # the answer, then the next message
    widths = fed_widths(model, monkeypatch)
    second = model.generate(turn2, max_new_tokens=16, lookahead=cfg, eos_token_id=[])
    # every token but the answer's last was fed, so its entry exists; the last step may have committed past the token
    # limit (entries of accepted tokens the answer cut), which a prompt repeating them reuses as well
    known = len(TURN1) + len(first.tokens) - 1
    assert known <= model.runner.reused < len(turn2) and widths[0] == len(turn2) - model.runner.reused
    monkeypatch.undo()
    assert second.tokens == fresh.generate(turn2, max_new_tokens=16, eos_token_id=[]).tokens


def test_what_cannot_be_reused_prefills_as_before(tiny_checkpoint):
    """A different prompt shares only its common prefix; a batch in between forgets the history."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    fresh = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.generate(TURN1, max_new_tokens=8, eos_token_id=[])
    other = TURN1[:3] + [60, 61, 62]
    assert model.generate(other, max_new_tokens=8, eos_token_id=[]).tokens == \
        fresh.generate(other, max_new_tokens=8, eos_token_id=[]).tokens
    assert model.runner.reused == 3
    model.generate([TURN1, other], max_new_tokens=4, eos_token_id=[])
    model.generate(TURN1, max_new_tokens=4, eos_token_id=[])
    assert model.runner.reused == 0
    assert model.generate(TURN1, max_new_tokens=8, eos_token_id=[]).tokens == \
        fresh.generate(TURN1, max_new_tokens=8, eos_token_id=[]).tokens
    assert model.runner.reused == len(TURN1) - 1  # the whole prompt but its last token, whose logits are needed


def test_preparing_shapes_forgets_the_history(tiny_checkpoint):
    """A capture writes placeholder entries from each row's L on, over entries a next prompt could have resumed from:
    after one, the next prompt prefills whole."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.generate(TURN1, max_new_tokens=8, eos_token_id=[])
    model.warmup(LookaheadConfig(2, 3, 2), max_tokens=64, process_group=None, sampling=True)  # ends with [0]'s turn
    with torch.inference_mode():  # as generation runs the runner
        model.runner.reset()
        assert model.runner.history  # [0] and its answer: the warm-up's generation
        model.runner.capture([])
    assert model.runner.history is None
    model.generate(TURN1, max_new_tokens=8, eos_token_id=[])
    assert model.runner.reused == 0
