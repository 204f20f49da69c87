"""The server's answers against the real openai client: every answer is what `Llama.generate` gives for that request
alone, whatever else is being served (concurrent clients with staggered arrivals, greedy and seeded sampling, warm
drafts and steps of random sizes, chat and completions, streamed or not); stop strings that end inside a multi-token
step or across two; max_tokens 1 and stop tokens; logprobs. (Limits and errors: test_serve_limits.py.)

The tiny servers serve a random LLaMA with a byte-level tokenizer (conftest's `served_dir`), so the text is arbitrary
bytes, incomplete and invalid UTF-8 everywhere; the tests marked slow serve the default model, one server for all.
"""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import RandomCost
from lookahead import LookaheadConfig
from lookahead.models import Llama
from served import PROMPTS, TIMEOUT, Running, ask, chat_ids, expected, open_stream, prompt_ids, read_event

# (endpoint, streamed, temperature, top_p, top_k, seed): greedy, and seeded sampling at two temperatures with top_p
CLIENTS = [("chat", False, 0.0, None, None, None), ("chat", True, 0.0, None, None, None),
           ("completions", False, 0.0, None, None, None), ("completions", True, 0.7, 0.9, None, 11),
           ("chat", False, 0.7, 0.9, None, 12), ("chat", True, 1.3, 0.8, None, 13),
           ("completions", False, 1.3, 0.8, 5, 14), ("completions", True, 0.0, None, None, None)]


@pytest.fixture(scope="module")
def random_steps(served_dir):
    """Step sizes drawn at random every step (a cost model that answers at random)."""
    server = Running(served_dir, cost=RandomCost(3), max_batch=4, max_queue=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fixed(served_dir):
    """Full-size steps, drafting cold: a prompt's steps are the same every time (the stop-string test reads them)."""
    server = Running(served_dir, lookahead=LookaheadConfig(budget="fixed", warm=False), max_batch=4, max_queue=16)
    yield server
    server.stop()


@pytest.mark.parametrize("name", ["warm_server", "random_steps"])
def test_concurrent_clients_each_get_what_they_get_alone(name, request, served_reference):
    """8 clients arriving 30 ms apart, greedy and seeded sampling, chat and completions, streamed or not: each
    answer's text and token count equal `Llama.generate` alone on the same prompt."""
    reference = served_reference
    server = request.getfixturevalue(name)
    clients = [server.client() for _ in CLIENTS]
    limits = [24, 40, 32, 28, 36, 30, 44, 20]

    def run(i):
        endpoint, stream, temperature, top_p, top_k, seed = CLIENTS[i]
        time.sleep(0.03 * i)
        options = dict(max_tokens=limits[i], temperature=temperature)
        if top_p is not None:
            options["top_p"] = top_p
        if seed is not None:
            options["seed"] = seed
        if top_k is not None:
            options["extra_body"] = {"top_k": top_k}
        return ask(clients[i], server.name, endpoint, PROMPTS[i], stream, **options)

    steps_before = server.metric("batch_size_count")
    rows_before = server.metric("batch_size_sum")
    with ThreadPoolExecutor(len(CLIENTS)) as pool:
        answers = list(pool.map(run, range(len(CLIENTS)), timeout=TIMEOUT))
    compressions = []
    for i, answer in enumerate(answers):
        endpoint, stream, temperature, top_p, top_k, seed = CLIENTS[i]
        ids = prompt_ids(server.tokenizer, endpoint, PROMPTS[i])
        want = expected(reference, server.tokenizer, ids, limits[i], temperature, top_p or 1.0, top_k or 0, seed)
        assert answer["text"] == want.text, (i, CLIENTS[i])
        assert answer["usage"].completion_tokens == len(want.tokens), (i, CLIENTS[i])
        assert answer["usage"].prompt_tokens == len(ids) and answer["finish_reason"] == want.finish_reason
        compressions.append(answer["usage"].lookahead["compression"])
    assert max(compressions) > 1.2  # multi-token steps happened
    steps = server.metric("batch_size_count") - steps_before
    assert server.metric("batch_size_sum") - rows_before > steps  # and rows shared steps
    assert not server.engine.active and not server.engine.queued


def test_a_stream_concatenates_to_the_answer_and_its_logprobs(warm_server):
    server = warm_server
    client = server.client()
    for endpoint in ("chat", "completions"):
        logprobs = dict(logprobs=True, top_logprobs=3) if endpoint == "chat" else dict(logprobs=3)
        whole = ask(client, "tiny", endpoint, PROMPTS[2], False, max_tokens=48, temperature=0, **logprobs)
        streamed = ask(client, "tiny", endpoint, PROMPTS[2], True, max_tokens=48, temperature=0, **logprobs)
        assert streamed["text"] == whole["text"] and streamed["chunks"] > 3
        assert streamed["usage"].completion_tokens == whole["usage"].completion_tokens == 48


def stream_steps(server, prompt: str, max_tokens: int, **options) -> tuple[list[int], list[dict]]:
    """A greedy chat stream with logprobs: the tokens each chunk carried (one chunk per engine step) and the
    chunks' logprob entries."""
    conn, response = open_stream(server.port, "/v1/chat/completions", dict(
        model=server.name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        logprobs=True, stream=True, **options))
    groups, entries = [], []
    try:
        while (data := read_event(response)) not in (None, "[DONE]"):
            for choice in json.loads(data)["choices"]:
                if choice["logprobs"]:
                    groups.append(len(choice["logprobs"]["content"]))
                    entries.extend(choice["logprobs"]["content"])
    finally:
        conn.close()
    return groups, entries


def find_stop(tokenizer, tokens: list[int], groups: list[int], across: bool = False) -> tuple[str, int]:
    """A stop string first completed by token k: (the string, k). across False: k is inside a step of 3 or more
    tokens, not its last; True: k begins a step and the string begins in the step before (its start has been
    streamed past unless held back)."""
    starts = {sum(groups[:i]) for i in range(1, len(groups))}
    done = 0
    for size in groups:
        for k in range(done, done + size):
            if (k not in starts) if across else (size < 3 or k == done + size - 1):
                continue
            text, before = (tokenizer.decode(tokens[:n], skip_special_tokens=True) for n in (k + 1, k))
            for length in (3, 2) if across else (3, 2, 1):
                stop = text[-length:]
                spans = len(stop) > len(text) - len(before)
                if (len(text) > len(before) and "\ufffd" not in stop and stop.strip() and stop not in before
                        and (spans or not across)):
                    return stop, k
        done += size
    pytest.fail(f"no step offers a stop string {'across its start' if across else 'inside it'} (steps {groups})")


@pytest.mark.parametrize("across", [False, True], ids=["inside-a-step", "across-steps"])
def test_a_stop_string_ends_the_text_before_it_even_inside_a_multi_token_step(fixed, served_reference, across):
    """inside-a-step: the stop string is completed by a token inside a multi-token step: the engine takes no token
    after it. across-steps: the string begins in one step and ends in the next: its start is held back, never
    streamed. Either way the text ends right before the string and completion_tokens is plain decoding's count up
    to the token that completed it."""
    reference = served_reference
    prompt, limit = PROMPTS[6], 80
    groups, _ = stream_steps(fixed, prompt, limit)
    ids = chat_ids(fixed.tokenizer, prompt)
    plain = expected(reference, fixed.tokenizer, ids, limit)
    assert sum(groups) == len(plain.tokens)
    stop, k = find_stop(fixed.tokenizer, plain.tokens, groups, across)
    want = expected(reference, fixed.tokenizer, ids, limit, stop=stop)
    assert len(want.tokens) == k + 1 and want.finish_reason == "stop"
    client = fixed.client()
    for stream in (False, True):
        answer = ask(client, "tiny", "chat", prompt, stream, max_tokens=limit, temperature=0,
                     stop=[stop, "never-said"])
        assert answer["text"] == want.text and answer["finish_reason"] == "stop"
        assert answer["usage"].completion_tokens == k + 1
    if not across:
        cut_groups, _ = stream_steps(fixed, prompt, limit, stop=stop)
        assert sum(cut_groups) == k + 1 and cut_groups[-1] < groups[len(cut_groups) - 1]  # the step was cut


def test_max_tokens_1_and_a_stop_token(warm_server, served_reference):
    server, reference = warm_server, served_reference
    client = server.client()
    ids = chat_ids(server.tokenizer, PROMPTS[0])
    for endpoint in ("chat", "completions"):
        answer = ask(client, "tiny", endpoint, PROMPTS[0], False, max_tokens=1, temperature=0)
        assert answer["usage"].completion_tokens == 1 and answer["finish_reason"] == "length"
    plain = expected(reference, server.tokenizer, ids, 30)
    token = plain.tokens[12]  # a stop token (as EOS is one): the answer ends with its first occurrence
    first = plain.tokens.index(token)
    want = expected(reference, server.tokenizer, ids, 30, eos=[token])
    answer = ask(client, "tiny", "chat", PROMPTS[0], False, max_tokens=30, temperature=0,
                 extra_body={"stop_token_ids": [token]})
    assert answer["finish_reason"] == "stop" and answer["usage"].completion_tokens == first + 1
    assert answer["text"] == want.text


def test_logprobs_are_plain_decodings(warm_server, served_reference):
    """Each token's logprob is log_softmax of the model's logits for it (plain decoding's), top_logprobs sorted."""
    server, reference = warm_server, served_reference
    ids = chat_ids(server.tokenizer, PROMPTS[4])
    answer = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=32, temperature=0,
        logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    tokens = [entry.bytes[0] if len(entry.bytes) == 1 else None for entry in content]  # byte b is token b
    assert tokens == expected(reference, server.tokenizer, ids, 32).tokens
    with torch.inference_mode():
        logp = torch.log_softmax(reference(torch.tensor([ids + tokens]))[0].float(), -1)[len(ids) - 1 : -1]
    for i, entry in enumerate(content):
        assert abs(entry.logprob - logp[i, tokens[i]].item()) < 1e-4
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True) and len(top) == 5
        assert max(abs(a - b) for a, b in zip(top, logp[i].topk(5).values.tolist(), strict=True)) < 1e-4
    legacy = server.client().completions.create(model="tiny", prompt=ids, max_tokens=32, temperature=0, logprobs=2)
    values = legacy.choices[0].logprobs.token_logprobs
    assert max(abs(a - logp[i, t].item()) for i, (a, t) in enumerate(zip(values, tokens, strict=True))) < 1e-4


@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings_of_streams_and_cancels(random_steps, served_reference, seed):
    """Random prompts, limits and settings, some clients leaving early: every answer that ends is exact, and the
    engine ends with no rows."""
    reference = served_reference
    rng = random.Random(seed)
    specs = [(rng.choice(["chat", "completions"]), rng.random() < 0.5, rng.choice([0.0, 0.0, 0.8]),
              "".join(rng.choice("ab c\né✓") for _ in range(rng.randrange(1, 30))), rng.randrange(1, 40),
              rng.random() < 0.25) for _ in range(6)]

    def run(i):
        endpoint, stream, temperature, prompt, limit, leave = specs[i]
        time.sleep(rng.random() * 0.1)
        if leave:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            body = dict(model="tiny", max_tokens=400, ignore_eos=True, stream=True, temperature=0)
            body |= {"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt}
            conn, response = open_stream(random_steps.port, path, body)
            read_event(response)
            conn.close()
            return None
        return ask(random_steps.client(), "tiny", endpoint, prompt, stream, max_tokens=limit,
                   temperature=temperature, seed=100 + i)

    with ThreadPoolExecutor(len(specs)) as pool:
        answers = list(pool.map(run, range(len(specs)), timeout=TIMEOUT))
    for i, ((endpoint, _, temperature, prompt, limit, leave), answer) in enumerate(zip(specs, answers, strict=True)):
        if leave:
            continue
        ids = prompt_ids(random_steps.tokenizer, endpoint, prompt)
        want = expected(reference, random_steps.tokenizer, ids, limit, temperature, seed=100 + i)
        assert answer["text"] == want.text and answer["usage"].completion_tokens == len(want.tokens), specs[i]
    random_steps.wait_for(lambda: not random_steps.engine.active and not random_steps.engine.queued,
                          "the engine to empty")


# ----- the default model (one server for the module) -----

@pytest.fixture(scope="module")
def smol(default_model_dir):
    server = Running(default_model_dir, "SmolLM2-135M-Instruct", max_batch=8, max_queue=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smol_reference(default_model_dir):
    return Llama.from_pretrained(default_model_dir)


SMOL_PROMPTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
                "Name three primary colors.", "Write the alphabet in capital letters.", "Say hello in Spanish.",
                "What is 12 times 12?", "List the days of the week.", "Explain what a hash table is."]


@pytest.mark.slow
def test_default_model_concurrent_clients_each_get_what_they_get_alone(smol, smol_reference):
    clients = [smol.client() for _ in SMOL_PROMPTS]
    settings = [(0.0, None, None), (0.7, 0.9, 21), (1.0, 0.8, 22), (0.0, None, None)] * 2

    def run(i):
        temperature, top_p, seed = settings[i]
        time.sleep(0.05 * i)
        extra = {} if seed is None else dict(top_p=top_p, seed=seed)
        return ask(clients[i], smol.name, "chat", SMOL_PROMPTS[i], i % 2 == 1, max_tokens=24,
                   temperature=temperature, **extra)

    with ThreadPoolExecutor(len(SMOL_PROMPTS)) as pool:
        answers = list(pool.map(run, range(len(SMOL_PROMPTS)), timeout=4 * TIMEOUT))
    for i, answer in enumerate(answers):
        temperature, top_p, seed = settings[i]
        want = expected(smol_reference, smol.tokenizer, chat_ids(smol.tokenizer, SMOL_PROMPTS[i]), 24, temperature,
                        top_p or 1.0, seed=seed)
        assert answer["text"] == want.text and answer["usage"].completion_tokens == len(want.tokens), i


@pytest.mark.slow
def test_default_model_stop_string_inside_a_multi_token_step_and_eos(smol, smol_reference):
    prompt, limit = SMOL_PROMPTS[0], 60
    groups, _ = stream_steps(smol, prompt, limit)
    ids = chat_ids(smol.tokenizer, prompt)
    plain = expected(smol_reference, smol.tokenizer, ids, limit)
    assert sum(groups) == len(plain.tokens)
    stop, k = find_stop(smol.tokenizer, plain.tokens, groups)
    want = expected(smol_reference, smol.tokenizer, ids, limit, stop=stop)
    answer = ask(smol.client(), smol.name, "chat", prompt, True, max_tokens=limit, temperature=0, stop=stop)
    assert answer["text"] == want.text and answer["usage"].completion_tokens == k + 1
    assert answer["finish_reason"] == "stop"
    # EOS: a short answer ends with the model's own end of turn
    ids = chat_ids(smol.tokenizer, SMOL_PROMPTS[1])
    want = expected(smol_reference, smol.tokenizer, ids, 64)
    answer = ask(smol.client(), smol.name, "chat", SMOL_PROMPTS[1], False, max_tokens=64, temperature=0)
    assert want.finish_reason == answer["finish_reason"] == "stop" and answer["text"] == want.text
    assert answer["usage"].completion_tokens == len(want.tokens)


def test_the_role_chunk_waits_for_the_first_token():
    """A stream's opening chunk (the assistant role) goes out with the first token, not before the prefill: clients
    (AIPerf, vLLM's bench) time the first token from the first chunk."""
    import asyncio
    from types import SimpleNamespace

    from lookahead.serve.completions import _Asked, _sse

    class Submission:
        def __init__(self) -> None:
            self.token = asyncio.Event()

        async def events(self):
            await self.token.wait()  # the prefill
            yield SimpleNamespace(finish_reason=None, text="Hi", logprobs=None, error=None)
            yield SimpleNamespace(finish_reason="stop", text="", logprobs=None, error=None, result=None)

        def cancel(self) -> None:
            pass

    class Format:
        def start(self):
            return [{"delta": {"role": "assistant", "content": ""}}]

        def chunk(self, text, logprobs, finish):
            return {"delta": {"content": text}, "finish_reason": finish}

    async def run() -> list[str]:
        submission = Submission()
        stream = _sse(submission, _Asked(SimpleNamespace(include_usage=False), [1, 2, 3], "prompt", Format()))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a chunk went out before the first token"
        submission.token.set()
        return [await first] + [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert [json.loads(c.removeprefix("data: ")) for c in chunks[:2]] == [
        {"delta": {"role": "assistant", "content": ""}}, {"delta": {"content": "Hi"}, "finish_reason": None}]
    assert chunks[-1] == "data: [DONE]\n\n"
