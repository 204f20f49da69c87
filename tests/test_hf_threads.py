"""lookahead.hf beside other callers of the same transformers model: a step's attention switch is invisible to a plain
forward or generate in another thread (padding included), and two lookahead generations whose steps overlap each get
their own tokens and leave the model's attention implementation as it was."""

import threading

import pytest
import torch
from transformers import LlamaForCausalLM

import lookahead.hf as lh
import lookahead.hf.step_model as hf_step_model
from lookahead import LookaheadConfig

REPETITIVE = [5, 17, 22, 5, 17, 9, 31, 5, 17, 22, 40, 5, 17, 22]
OTHER = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
NO_EOS = dict(eos_token_id=None, pad_token_id=0)
WAIT = 30  # seconds; a broken hand-over fails the assertions below instead of hanging the suite


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_checkpoint):
    """The tiny LLaMA under each of transformers' own implementations (eager needs its mask; sdpa can skip it)."""
    return LlamaForCausalLM.from_pretrained(tiny_checkpoint("gqa"), dtype=torch.float32,
                                            attn_implementation=request.param).eval()


def greedy(model, prompt, new=16):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, **NO_EOS)
    return out[0, len(prompt):].tolist()


def padded_batch():
    """Two prompts, the shorter left-padded: a plain call whose result depends on the attention mask."""
    ids = torch.tensor([[0, 0, 0, *OTHER[:-3]], OTHER])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def pause_first_step(monkeypatch, pause):
    """Run `pause(thread name)` at the first layer of a thread's first lookahead step (the step attention selected)."""
    real, paused = hf_step_model.masked_attention, set()

    def masked_attention(*args):
        name = threading.current_thread().name
        if name not in paused:
            paused.add(name)
            pause(name)
        return real(*args)

    monkeypatch.setattr(hf_step_model, "masked_attention", masked_attention)


def test_plain_calls_in_another_thread_during_a_step(model, monkeypatch):
    """Used to raise "attention 'lookahead' runs only inside lookahead.hf steps" in the plain caller."""
    ids, mask = padded_batch()
    with torch.no_grad():
        expected_logits = model(ids, attention_mask=mask).logits
    expected_batch = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **NO_EOS)
    expected_tokens = greedy(model, REPETITIVE, 24)
    own = model.config._attn_implementation
    in_step, plain_done, seen = threading.Event(), threading.Event(), {}

    def plain():
        assert in_step.wait(WAIT)
        try:
            with torch.no_grad():
                seen["logits"] = model(ids, attention_mask=mask).logits
            seen["batch"] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **NO_EOS)
        except Exception as e:  # reported below, in the test's thread
            seen["error"] = e
        finally:
            plain_done.set()

    pause_first_step(monkeypatch, lambda name: in_step.set() or plain_done.wait(WAIT))
    thread = threading.Thread(target=plain, name="plain")
    thread.start()
    result = lh.generate(model, REPETITIVE, 24, LookaheadConfig(5, 4, 5), eos_token_id=[])
    thread.join(WAIT)
    assert "error" not in seen, repr(seen.get("error"))
    assert torch.equal(seen["logits"], expected_logits)
    assert torch.equal(seen["batch"], expected_batch)
    assert result.tokens == expected_tokens
    assert model.config._attn_implementation == own


def test_two_lookahead_generations_whose_steps_overlap(model, monkeypatch):
    """A's first step starts, B's first step starts, A's step ends (its switch undone), then B's step goes on: B must
    still run the step attention, and the last step to end restores the model's own implementation."""
    own = model.config._attn_implementation
    expected = {"A": greedy(model, REPETITIVE, 24), "B": greedy(model, OTHER, 24)}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    waits = {"A": (a_in, b_in), "B": (b_in, a_out)}
    pause_first_step(monkeypatch, lambda name: waits[name][0].set() or waits[name][1].wait(WAIT))
    real_step = lh.HFStepModel.step

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        if threading.current_thread().name == "A":
            a_out.set()
        return out

    monkeypatch.setattr(lh.HFStepModel, "step", step)
    results = {}

    def run(name, prompt):
        try:
            results[name] = lh.generate(model, prompt, 24, LookaheadConfig(5, 4, 5), eos_token_id=[]).tokens
        except Exception as e:  # reported below, in the test's thread
            results[name] = e

    threads = [threading.Thread(target=run, args=(name, prompt), name=name)
               for name, prompt in (("A", REPETITIVE), ("B", OTHER))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 3)
    assert results == expected
    assert a_in.is_set() and b_in.is_set() and a_out.is_set()  # the steps did overlap as described
    assert model.config._attn_implementation == own
