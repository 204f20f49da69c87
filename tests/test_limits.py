"""Sizes and states that cannot work are refused at once, naming the value (issue 28 items 6 and 13): steps no model
could hold, a KV cache checked against what it needs (not its power-of-two rounding), a transformers model without
weights."""

from __future__ import annotations

import pytest
import torch

import lookahead.models.kv_cache as kv_cache
from lookahead import LookaheadConfig
from lookahead.cli import main
from lookahead.config import MAX_STEP_TOKENS
from lookahead.models import Llama


def test_steps_past_the_stated_maximum_are_refused():
    """LookaheadConfig(1, 4, 10000) on a tiny model produced nothing in 120 s (30003 tokens a step)."""
    with pytest.raises(ValueError, match=r"LookaheadConfig\(window=1, ngram=4, guesses=10000\) makes steps of "
                                         r"\(W \+ G\)\(N - 1\) = 30003 tokens; at most 1024"):
        LookaheadConfig(1, 4, 10000)
    assert LookaheadConfig(1, 2, MAX_STEP_TOKENS - 1).step_tokens == MAX_STEP_TOKENS
    with pytest.raises(ValueError, match="1025 tokens"):
        LookaheadConfig(1, 2, MAX_STEP_TOKENS)


def test_steps_the_model_could_never_hold_are_refused(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint())  # 512 positions
    with pytest.raises(ValueError, match=r"W=2, N=5, G=200 verifies up to G\(N - 1\) = 800 draft nodes a step, more "
                                         r"than the model's max_position_embeddings \(512\)"):
        model.generate([1, 2, 3], max_new_tokens=4, lookahead=LookaheadConfig(2, 5, 200))


def test_the_cli_refuses_them_before_torch_loads(capsys):
    assert main(["generate", "Hello", "-G", "10000"]) == 2
    assert capsys.readouterr().err.startswith("lookahead: error: -W/-N/-G: LookaheadConfig(window=1, ngram=4, "
                                              "guesses=10000) makes steps of (W + G)(N - 1) = 30003 tokens")


def block_bytes(model: Llama, blocks: int) -> int:
    """What a pool of `blocks` blocks (plus its scratch block) takes."""
    return kv_cache.KVShape.of(model.config).bytes(model.dtype, (blocks + 1) * 16)


def test_the_cache_is_checked_against_what_a_request_needs_not_its_rounding(tiny_checkpoint, monkeypatch):
    """A request of 19 blocks was refused as needing 32 (the pool is rounded up to a power of two before the memory
    check): a 2**25-token request needed twice what it needs. Where the rounding does not fit, the exact size does."""
    model = Llama.from_pretrained(tiny_checkpoint())
    plain = model.generate([1, 2, 3], max_new_tokens=300, eos_token_id=[]).tokens  # 304 positions: 19 blocks
    model.release()
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: block_bytes(model, 25))
    assert model.generate([1, 2, 3], max_new_tokens=300, eos_token_id=[]).tokens == plain
    assert model.runner.blocks.num_blocks == 19
    model.release()
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: block_bytes(model, 10))
    with pytest.raises(ValueError, match="the KV cache of 19 blocks of 16 positions needs"):  # what it needs, said
        model.generate([1, 2, 3], max_new_tokens=300, eos_token_id=[])


def test_a_growing_runner_is_checked_the_same_way(tiny_checkpoint, monkeypatch):
    model = Llama.from_pretrained(tiny_checkpoint())
    model.generate([1, 2, 3], max_new_tokens=8)  # the smallest pool: 16 blocks
    assert model.runner.blocks.num_blocks == 16
    # growing holds the old pool and the new one at once: room for 16 + 19 blocks, not 16 + 32
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: block_bytes(model, 19 + 2))
    model.generate([1, 2, 3], max_new_tokens=300, eos_token_id=[])
    assert model.runner.blocks.num_blocks == 19


def test_a_transformers_model_on_the_meta_device_is_refused_by_name(tiny_checkpoint):
    from transformers import AutoConfig, LlamaForCausalLM

    import lookahead.hf as lh

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_checkpoint()))
    with pytest.raises(ValueError, match="hf_model holds no weights: .* on the meta device .*init_empty_weights"):
        lh.generate(model, [1, 2, 3], 4)


@pytest.mark.parametrize("prompt, new", [(10, 6), (10, 7), (15, 1), (16, 1), (3, 40)], ids=lambda n: str(n))
def test_every_front_decides_prompt_plus_max_new_tokens_alike(prompt, new):
    """Whether a prompt and its new tokens fit the model's positions is decided once (`request.check_context`):
    `generate`'s request, the engine's submit and the server's max_new_tokens (with max_tokens given, and without: what
    remains) take the same requests and refuse the same, at the same edge (prompt + max_new_tokens == positions
    fits), and each refusal says what was too long and what to change."""
    from types import SimpleNamespace

    from helpers import MockRowModel
    from lookahead.loop import Capacity, Engine
    from lookahead.request import GenerateArgs, Request, Target, parse_request
    from lookahead.serve.completions import _max_new_tokens
    from lookahead.serve.errors import APIError
    from lookahead.serve.protocol import ChatCompletionRequest, CompletionRequest

    positions, ids = 16, [1] * prompt
    fits = prompt + new <= positions
    served = SimpleNamespace(max_positions=positions)
    messages = []

    def refused(check) -> bool:
        try:
            check()
        except (ValueError, APIError) as e:
            messages.append(str(e))
            return True
        return False

    engine = Engine(MockRowModel(24), capacity=Capacity(max_positions=positions))
    answers = {
        "generate": refused(lambda: parse_request(ids, GenerateArgs(new), Target(24, positions))),
        "engine": refused(lambda: engine.submit(Request([ids], new))),
        "server": refused(lambda: _max_new_tokens(served, CompletionRequest(model="m", prompt=ids, max_tokens=new),
                                                  prompt, "prompt")),
    }
    assert answers == dict.fromkeys(answers, not fits)
    for message in messages[:2]:
        assert f"prompt ({prompt} tokens) + max_new_tokens ({new}) = {prompt + new} exceeds the model's" in message
        assert message.endswith("shorten the prompt or lower max_new_tokens")
    if messages:
        assert messages[2].startswith(f"This model's maximum context length is {positions} tokens. However, you "
                                      f"requested {prompt + new} tokens") and "Please reduce" in messages[2]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])  # no limit: what remains
    if prompt < positions:
        remaining = _max_new_tokens(served, chat, prompt, "messages")
        assert remaining == positions - prompt and not refused(lambda: engine.submit(Request([ids], remaining)))
    else:
        assert refused(lambda: _max_new_tokens(served, chat, prompt, "messages"))


@pytest.mark.parametrize("kind, fields, asked, param", [
    ("chat", {"max_completion_tokens": 5, "max_tokens": 9}, 5, "max_completion_tokens"),
    ("chat", {"max_tokens": 6}, 6, "max_tokens"),
    ("chat", {"n_predict": 7}, 7, "n_predict"),
    ("chat", {"n_predict": -1}, None, "n_predict"),
    ("chat", {}, None, "max_tokens"),
    ("completion", {"max_tokens": 6}, 6, "max_tokens"),
    ("completion", {"n_predict": 7}, 7, "n_predict"),
    ("completion", {"n_predict": -1}, None, "n_predict"),
    ("completion", {}, 16, "max_tokens"),
], ids=lambda v: None)
def test_max_tokens_carries_one_name_from_the_body_to_the_stop(kind, fields, asked, param):
    """Past the API's own fields (max_tokens, max_completion_tokens, n_predict) the count of new tokens is
    `max_new_tokens` all the way: the body's property (and the field that gave it), the server's answer for the
    engine, the engine's `Request` and the `Output` that stops on it, which takes exactly that many."""
    from types import SimpleNamespace

    from lookahead.loop.core import Output
    from lookahead.request import Request
    from lookahead.serve.completions import _max_new_tokens
    from lookahead.serve.protocol import ChatCompletionRequest, CompletionRequest

    body = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields) if kind == "chat"
            else CompletionRequest(model="m", prompt="hi", **fields))
    assert (body.max_new_tokens, body.max_new_tokens_param) == (asked, param)
    max_new_tokens = _max_new_tokens(SimpleNamespace(max_positions=64), body, 4, "prompt")
    assert max_new_tokens == (64 - 4 if asked is None else asked)  # None: what remains of the positions
    request = Request([[1] * 4], max_new_tokens)
    out = Output(request.max_new_tokens, (), None)
    while not out.done:
        out.accept([3, 3, 3], fed=3)
    assert len(out.result.tokens) == out.max_new_tokens == max_new_tokens and out.result.finish_reason == "length"
