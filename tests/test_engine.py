"""The engine: requests that join, leave and are cancelled at random times, with their own sampling settings and
seeds, each get exactly what they get alone (a property test over random arrival schedules, on the mock model and the
tiny LLaMA); its thread, handles, limits and failures."""

import importlib.util
import random
import sys
import threading
from pathlib import Path

import pytest

from helpers import MockRowModel, MockStepModel, RandomCost, context_logits, decode_one, needs_interpreter, one
from lookahead import LookaheadConfig
from lookahead.loop import Capacity, Engine, QueueFull, RowStep, path_step
from lookahead.models import Llama, engine_for
from lookahead.request import Request, SamplingParams
from lookahead.tuning import CostModel, Curve

VOCAB = 24
TARGET = [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 6  # each token determines the next: drafts pay


def logits_fn(ctx):
    return context_logits(ctx, VOCAB, target=[1, 2] + TARGET)


SETTINGS = [SamplingParams(), SamplingParams(0.8), SamplingParams(1.0, top_p=0.8), SamplingParams(0.7, top_k=5)]
CONFIGS = [None, LookaheadConfig(1, 4, 5, warm=False), LookaheadConfig(2, 3, 2, warm=False),
           LookaheadConfig(3, 4, 3, budget="fixed", warm=False)]


def random_request(rng: random.Random) -> dict:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    if rng.random() < 0.4:  # some follow the known text: multi-token steps happen
        prompt = [1, 2] + TARGET[: rng.randrange(4, 20)]
    return dict(prompt=prompt, max_new_tokens=rng.randrange(1, 40), sampling=rng.choice(SETTINGS),
                seed=rng.randrange(1000), lookahead=rng.choice(CONFIGS),
                stop=[rng.randrange(VOCAB)] if rng.random() < 0.3 else [])


def alone(spec: dict):
    seed = None if spec["sampling"].greedy else spec["seed"]
    return decode_one(MockStepModel(VOCAB, logits_fn), spec["prompt"], spec["max_new_tokens"], spec["sampling"],
                      spec["lookahead"], stop=spec["stop"], seed=seed)


def submit(engine: Engine, spec: dict, **extra):
    return engine.submit(one(spec["prompt"], spec["max_new_tokens"], sampling=spec["sampling"],
                             seed=None if spec["sampling"].greedy else spec["seed"], stop_token_ids=spec["stop"],
                             lookahead=spec["lookahead"]), **extra)


@pytest.mark.parametrize("schedule", range(12), ids=lambda s: f"schedule{s}")
def test_any_arrival_schedule_gives_every_request_what_it_gets_alone(schedule):
    """Arrivals at random steps, random cancellations, a few rows at most (the rest wait), prompts prefilled in chunks
    beside decoding rows, step sizes drawn at random: each finished request equals its run alone, and a cancelled
    one is a prefix of it."""
    rng = random.Random(schedule)
    specs = [random_request(rng) for _ in range(10)]
    arrivals = sorted(rng.randrange(25) for _ in specs)
    cancels = {i: arrivals[i] + rng.randrange(1, 8) for i in range(len(specs)) if rng.random() < 0.2}
    model = MockRowModel(VOCAB, logits_fn, prefill_chunk=rng.choice([None, 4, 9]), max_rows=rng.choice([2, 3, 8]))
    engine = Engine(model, cost=RandomCost(schedule))
    handles: dict[int, object] = {}
    for step in range(400):
        for i, at in enumerate(arrivals):
            if at == step:
                handles[i] = submit(engine, specs[i])
            if cancels.get(i) == step and i in handles:
                handles[i].cancel()
        if not engine.step() and len(handles) == len(specs):
            break
    assert len(handles) == len(specs) and not engine.active and not engine.waiting
    for i, spec in enumerate(specs):
        result, expected = handles[i].result(), alone(spec)
        if result.finish_reason == "cancelled":
            assert i in cancels and result.tokens == expected.tokens[: len(result.tokens)]
        else:
            assert result.tokens == expected.tokens, (i, spec)
            assert result.finish_reason == ("stop" if expected.tokens[-1:] and expected.tokens[-1] in spec["stop"]
                                            else "length")
    assert not model.rows  # every row released


def test_deltas_stream_the_tokens_and_the_last_carries_the_result():
    engine = Engine(MockRowModel(VOCAB, logits_fn))
    spec = dict(prompt=[1, 2, 7, 3], max_new_tokens=20, sampling=SamplingParams(), seed=0,
                lookahead=LookaheadConfig(2, 3, 2, warm=False), stop=[])
    handle = submit(engine, spec, logprobs=2)
    while engine.step():
        pass
    deltas = list(handle)
    assert [t for d in deltas for t in d.tokens] == alone(spec).tokens == handle.result().tokens
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert deltas[-1].result is handle.result() and any(len(d.tokens) > 1 for d in deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token for lp in logprobs] == handle.result().tokens and all(len(lp.top) == 2 for lp in logprobs)


def test_logprobs_equal_plain_decodings():
    """Each token's log-probability is log_softmax of the logits that chose it: what plain decoding computes."""
    import torch

    engine = Engine(MockRowModel(VOCAB, logits_fn))
    prompt = [5, 1, 2, 7, 3, 9]
    handle = engine.submit(one(prompt, 24, lookahead=LookaheadConfig(2, 3, 2, warm=False)), logprobs=3)
    while engine.step():
        pass
    result = handle.result()
    assert any(len(t) > 1 for t in result.step_tokens)  # multi-token steps did happen
    for i, lp in enumerate(result.logprobs):
        expected = torch.log_softmax(logits_fn(prompt + result.tokens[:i]).float(), -1)
        assert abs(lp.logprob - expected[lp.token].item()) < 1e-5
        assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()


def test_a_stop_string_inside_a_multi_token_step_ends_the_output_where_plain_decoding_would():
    """stops_at sees each token in turn: the tokens after the one that completes the stop are never taken."""
    spec = dict(prompt=[1, 2] + TARGET[:15], max_new_tokens=30, sampling=SamplingParams(), seed=0,
                lookahead=LookaheadConfig(2, 3, 2, warm=False), stop=[])
    reference = alone(spec)
    full = reference.tokens
    # the stop "string": tokens full[cut - 1], full[cut] in a row, where full[cut] is inside a step of 3+ tokens
    done = 0
    for taken in reference.step_tokens:
        if len(taken) >= 3 and done > 0:
            cut = done + 1
            break
        done += len(taken)
    seen: list[int] = []

    def stops_at(token):
        seen.append(token)
        return seen[-2:] == full[cut - 1 : cut + 1]

    engine = Engine(MockRowModel(VOCAB, logits_fn))
    handle = submit(engine, spec, stops_at=stops_at)
    while engine.step():
        pass
    result = handle.result()
    assert result.tokens == full[: cut + 1] and result.finish_reason == "stop"
    assert len(result.step_tokens[-1]) < len(reference.step_tokens[len(result.step_tokens) - 1])  # cut mid-step


def test_the_engine_thread_serves_submitters_of_many_threads():
    engine = Engine(MockRowModel(VOCAB, logits_fn, max_rows=3), cost=RandomCost(5))
    engine.start()
    specs = [random_request(random.Random(100 + i)) for i in range(12)]
    results: dict[int, list[int]] = {}

    def client(i):
        results[i] = list(submit(engine, specs[i]).tokens())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.stop(10)
    assert {i: results[i] for i in range(len(specs))} == {i: alone(s).tokens for i, s in enumerate(specs)}


def test_stop_cancels_what_is_left_and_refuses_new_requests():
    engine = Engine(MockRowModel(VOCAB, logits_fn, max_rows=1))
    first = engine.submit(one([1, 2, 3], 30))
    second = engine.submit(one([4, 5], 30))
    engine.step()
    engine.stop()
    while engine.step():
        pass
    assert first.result().finish_reason == second.result().finish_reason == "cancelled"
    with pytest.raises(QueueFull, match="shutting down"):
        engine.submit(one([1], 2))


def test_the_queue_limit_and_bad_requests_are_refused_at_submit():
    engine = Engine(MockRowModel(VOCAB, logits_fn), capacity=Capacity(max_queue=2, max_positions=20))
    engine.submit(one([1], 2))
    engine.submit(one([1], 2))
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        engine.submit(one([1], 2))
    engine.model.max_step_tokens = 18
    for bad, message in [(dict(prompt=[1], max_new_tokens=2, lookahead=LookaheadConfig(3, 4, 5)), "at most 18"),
                         (dict(prompt=[], max_new_tokens=2), "at least one prompt"),
                         (dict(prompt=[1] * 15, max_new_tokens=10), "exceeds the model's 20 positions"),
                         (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
                         (dict(prompt=[1], max_new_tokens=2, logprobs=21), "logprobs"),
                         (dict(prompt=[1], max_new_tokens=2, stop_token_ids=[-1]), "token ids >= 0")]:
        logprobs = bad.pop("logprobs", None)
        with pytest.raises((ValueError, TypeError), match=message):
            engine.submit(one(**bad), logprobs=logprobs)
    with pytest.raises(TypeError, match="submit takes a lookahead.request.Request, got list"):
        engine.submit([1, 2])
    with pytest.raises(ValueError, match="a request of one prompt, got 2"):
        engine.submit(Request([[1], [2]], 2))


def test_token_ids_are_checked_against_the_vocabulary_at_submit_and_the_context_edge_is_accepted(tiny_checkpoint):
    """A prompt holding id == vocab size is refused at submit (it used to fail every row of its step with an
    IndexError, its neighbours' too); vocab size - 1 is a token, and prompt + max_new_tokens == the model's positions
    fits (one more does not)."""
    from helpers import flat_cost
    from lookahead.models import engine_for

    model = Llama.from_pretrained(tiny_checkpoint("ctx64", max_position_embeddings=64))
    model.cost_model = flat_cost()
    engine = engine_for(model, max_batch=2, lookahead=LookaheadConfig(1, 3, 2, warm=False), warm=False)
    good = engine.submit(one([100, 5, 7], 12))
    with pytest.raises(ValueError, match=r"token id\(s\) \[101\] outside the model's vocabulary \[0, 101\)"):
        engine.submit(one([5, 101], 4))
    edge = engine.submit(one(list(range(24)), 40))
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        engine.submit(one(list(range(25)), 40))
    while engine.step():
        pass
    reference = Llama.from_pretrained(tiny_checkpoint("ctx64", max_position_embeddings=64))
    assert good.result().tokens == reference.generate([100, 5, 7], max_new_tokens=12, eos_token_id=[]).tokens
    assert edge.result().tokens == reference.generate(list(range(24)), max_new_tokens=40, eos_token_id=[]).tokens
    assert len(edge.result().tokens) == 40


class KindCost(CostModel):
    """A cost model that learns nothing: greedy steps of any size cost the same (drafts always pay); sampled steps
    cost twice as much for every token more (they never do, beside any rows)."""

    def __init__(self) -> None:
        super().__init__({"greedy": Curve([1], [1.0], [0.0]), "sampling": Curve([1], [1.0], [0.0])})

    def predict(self, tokens: int, length: int, kind: str = "greedy") -> float:
        return 0.01 if kind == "greedy" else 2.0 ** min(tokens, 1000)

    def observe(self, tokens: int, length: int, seconds: float, kind: str = "greedy") -> None:
        pass


@pytest.mark.parametrize("first", ["greedy-auto", "sampled-auto"])
def test_each_row_is_sized_by_its_own_kind_and_configuration_not_the_first_requests(first):
    """A budget="fixed" request runs full-size steps and a sampled one is costed with the sampling curve, whatever
    request came first (the first lookahead request's budget used to size every row: a fixed request after an auto
    one got self-tuned steps, a sampled one the greedy curve). Each takes the steps it takes alone."""
    prompt = [1, 2] + TARGET[:10]
    specs = {"greedy-auto": dict(lookahead=LookaheadConfig(1, 4, 5, warm=False)),
             "sampled-auto": dict(lookahead=LookaheadConfig(1, 4, 5, warm=False), sampling=SamplingParams(0.9),
                                  seed=5),
             "fixed": dict(lookahead=LookaheadConfig(1, 4, 5, budget="fixed", warm=False))}
    order = [first, "fixed", "sampled-auto" if first == "greedy-auto" else "greedy-auto"]

    def run(names):
        engine = Engine(MockRowModel(VOCAB, logits_fn), cost=KindCost())
        handles = []
        for name in names:
            handles.append(engine.submit(one(prompt, 30, **specs[name])))
            engine.step()
            engine.step()
        while engine.step():
            pass
        return [handle.result() for handle in handles]

    together = run(order)
    for name, result in zip(order, together, strict=True):
        (alone,) = run([name])
        assert (result.tokens, result.steps) == (alone.tokens, alone.steps), name
    steps = {name: result.steps for name, result in zip(order, together, strict=True)}
    assert steps["fixed"] < steps["sampled-auto"] and steps["greedy-auto"] < steps["sampled-auto"]


class NoRoomForLong(MockRowModel):
    """A model that keeps answering "no room yet" for prompts of more than 10 tokens, even with no row live."""

    def admit(self, prompt, positions):
        return None if len(prompt) > 10 else super().admit(prompt, positions)


def test_a_request_the_model_refuses_with_no_row_live_fails_instead_of_waiting_forever():
    engine = Engine(NoRoomForLong(VOCAB, logits_fn))
    long = engine.submit(one(list(range(12)), 4))
    with pytest.raises(RuntimeError, match="no room for a request of 12 prompt tokens"):
        for _ in range(5):  # bounded: the engine used to spin here forever
            engine.step()
    with pytest.raises(RuntimeError, match="no room"):
        long.result(0)
    with pytest.raises(RuntimeError, match="no room"):  # a library caller's run raises it too
        engine.run(Request([list(range(12))], 4))
    engine.start()  # the engine's thread fails it and goes on
    long, short = engine.submit(one(list(range(12)), 4)), engine.submit(one([1, 2, 3], 5))
    with pytest.raises(RuntimeError, match="no room"):
        long.result(30)
    assert short.result(30).tokens == decode_one(MockStepModel(VOCAB, logits_fn), [1, 2, 3], 5).tokens
    engine.stop(10)


def test_the_default_kv_cache_is_sized_from_the_model_and_max_model_len(tiny_checkpoint, monkeypatch):
    """max_batch rows of max_model_len (requests past it refused), at most twice the weights' bytes beyond the floor
    (a 135M model held 3 GB for 8 rows of its 8192 positions), and never less than one such row."""
    from helpers import flat_cost
    from lookahead.models import engine_for, serving
    from lookahead.models.runner import BLOCK_SIZE

    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.cost_model = flat_cost()
    engine = engine_for(model, max_batch=4, lookahead=None, max_model_len=100)
    row = -(-(100 + 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert engine.max_positions == 100 and engine.model.capacity == 4 * row
    with pytest.raises(ValueError, match="exceeds the model's 100 positions"):
        engine.submit(one([1] * 90, 11))
    with pytest.raises(ValueError, match="max_model_len \\(513\\) exceeds the model's max_position_embeddings"):
        engine_for(model, max_model_len=513)
    monkeypatch.setattr(serving, "KV_FLOOR_BYTES", 0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    engine = engine_for(model, max_batch=64, lookahead=None)
    full = -(-(512 + 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert full < engine.model.capacity and engine.model.capacity * per_position <= 2 * weights
    monkeypatch.setattr(serving, "WEIGHTS_MULTIPLE", 0)
    assert engine_for(model, max_batch=64, lookahead=None).model.capacity == full  # one full row at least


def test_a_failing_step_fails_its_rows_and_the_engine_goes_on():
    model = MockRowModel(VOCAB, logits_fn)
    engine = Engine(model)
    engine.start()
    broken = model.step
    calls = []

    def step(steps):
        calls.append(len(steps))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return broken(steps)

    model.step = step
    first = engine.submit(one([1, 2, 3], 5))
    with pytest.raises(RuntimeError, match="device lost"):
        first.result(30)
    second = engine.submit(one([1, 2, 3], 5))
    assert second.result(30).tokens == decode_one(MockStepModel(VOCAB, logits_fn), [1, 2, 3], 5).tokens
    engine.stop(10)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_tiny_llama_rows_joining_a_running_batch_equal_each_alone(tiny_checkpoint, backend):
    """The real runner on both attention backends: rows join while others decode (a long prompt prefilled in chunks
    beside them), with their own sampling settings, at step sizes drawn at random; each equals its own
    `Llama.generate`."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend=backend)
    reference = Llama.from_pretrained(tiny_checkpoint("gqa"))
    from lookahead.models.generation import runner_for
    from lookahead.request import Request

    runner = runner_for(model, Request([[0] * 60] * 4, 40, lookahead=LookaheadConfig()))
    runner.prefill_chunk = 16
    engine = Engine(runner, cost=RandomCost(1))
    rng = random.Random(7)
    specs = []
    for i in range(6 if backend == "torch" else 3):  # the interpreter is slow
        prompt = [rng.randrange(101) for _ in range(rng.choice([3, 9, 50]))]
        sampling = SETTINGS[i % len(SETTINGS)]
        specs.append((prompt, sampling, None if sampling.greedy else 10 + i,
                      [None, LookaheadConfig(2, 3, 2, warm=False)][i % 2]))
    handles = []
    for i, (prompt, sampling, seed, cfg) in enumerate(specs):
        handles.append(engine.submit(one(prompt, 20 if backend == "torch" else 8, sampling=sampling, seed=seed,
                                     lookahead=cfg)))
        for _ in range(i % 3):
            engine.step()
    while engine.step():
        pass
    for handle, (prompt, sampling, seed, _) in zip(handles, specs, strict=True):
        expected = reference.generate(prompt, max_new_tokens=20 if backend == "torch" else 8,
                                      temperature=sampling.temperature,
                                      top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, eos_token_id=[])
        assert handle.result().tokens == expected.tokens
    assert not runner.rows and runner.blocks.held == 0


class LengthCost(CostModel):
    """Steps cost a fixed 20 ms, 1 ms a token and 2 us a token per cached position (a CPU's GEMMs, then attention),
    and learn nothing."""

    STEP, TOKEN, POSITION = 0.02, 0.001, 2e-6  # seconds a step, a token, a token per cached position

    def __init__(self) -> None:
        super().__init__({"greedy": Curve([1], [1.0], [0.0])})

    def predict(self, tokens: int, length: int, kind: str = "greedy") -> float:
        return self.STEP + self.TOKEN * tokens + self.POSITION * tokens * length

    def observe(self, tokens: int, length: int, seconds: float, kind: str = "greedy") -> None:
        pass


class ChunkRecorder(MockRowModel):
    """A `MockRowModel` that also records each step's prompt chunk of row `watched` (None: none) and its decoding
    rows' tokens, with the cache lengths they ran at; and a clock (`clock`, for the engine) that each step moves on by
    what `LengthCost` says it costs, a prompt chunk's attention `chunk_attention` times that (a model fit on short
    caches under-prices a chunk deep in a long prompt)."""

    def __init__(self, *args, watched: int = 0, chunk_attention: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watched, self.chunk_attention, self.now = watched, chunk_attention, 0.0
        self.cached: dict[int, int] = {}
        self.steps: list[tuple[tuple[int, int] | None, list[tuple[int, int]]]] = []
        self.seconds: list[float] = []  # each step's

    def clock(self) -> float:
        return self.now

    def step(self, steps):
        chunk = next(((len(s.tokens), self.cached.get(s.row, 0)) for s in steps
                      if s.prefill and s.row == self.watched), None)
        decoding = [(len(s.tokens), self.cached.get(s.row, 0)) for s in steps if not s.prefill]
        self.steps.append((chunk, decoding))
        seconds = LengthCost.STEP
        for s in steps:
            n, length = len(s.tokens), self.cached.get(s.row, 0)
            attention = LengthCost.POSITION * (self.chunk_attention if s.prefill else 1.0)
            seconds += LengthCost.TOKEN * n + attention * n * length
            self.cached[s.row] = length + (n if s.prefill else 1)
        self.now += seconds
        self.seconds.append(seconds)
        return super().step(steps)


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(1, 4, 5, warm=False)], ids=["plain", "lookahead"])
def test_a_long_prompt_beside_decoding_rows_never_stalls_them(lookahead):
    """While a 3,000-token prompt prefills beside a decoding row (and alone once that row ends), each step with a
    prompt chunk costs at most `CHUNK_COST` times the decoding row's step alone by the cost model, priced at the
    chunk's own cache length, so the chunks shrink as the prompt's cache grows (a fixed 512-token budget made a chunk
    at 6k positions cost seconds); every chunk carries a token at least; the long prompt's answer is its own; alone, a
    prompt takes whole chunks."""
    from lookahead.loop.scheduler import CHUNK_COST

    cost = LengthCost()
    model = ChunkRecorder(VOCAB, logits_fn, prefill_chunk=512, watched=1)
    engine = Engine(model, cost=cost, clock=model.clock)
    engine.submit(one([1, 2, 3], 400, lookahead=lookahead))
    for _ in range(3):
        engine.step()
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(3000)]
    handle = engine.submit(one(prompt, 4, lookahead=lookahead))
    while engine.step() and not handle.done:
        pass
    chunks = [(chunk, decoding) for chunk, decoding in model.steps if chunk is not None]
    assert sum(size for (size, _), _ in chunks) == len(prompt)
    beside = [(chunk, decoding) for chunk, decoding in chunks if decoding]  # the first row ends after 400 tokens
    assert len(beside) > 100
    for (size, filled), decoding in beside:
        assert size >= 1
        fed = sum(n for n, _ in decoding)
        weight = sum(n * length for n, length in decoding)
        alone_cost = cost.predict(fed, weight // fed)
        # the scheduler counts a lookahead row as 1 + its levels tokens, its actual step may feed fewer
        assert cost.predict(fed + size, (weight + size * filled) // (fed + size)) <= CHUNK_COST * alone_cost * 1.25
    assert beside[0][0][0] > 4 * beside[-1][0][0]  # deep into the prompt a token costs more, so fewer of them
    assert handle.result().tokens == alone({"prompt": prompt, "max_new_tokens": 4, "sampling": SamplingParams(),
                                             "lookahead": lookahead, "stop": []}).tokens
    model = ChunkRecorder(VOCAB, logits_fn, prefill_chunk=512)
    Engine(model, cost=cost).run(Request([prompt], 2))
    assert [chunk[0] for chunk, _ in model.steps if chunk is not None] == [512] * 5 + [440]


def test_chunks_the_cost_model_under_prices_are_priced_at_what_their_steps_took():
    """Where a chunk's attention costs four times what the cost model says (its per-position cost, fit on short
    caches, under-prices a long prompt's cache read from memory), the scheduler learns it from the steps (`scales`:
    what steps with a chunk and steps without took over the model's figures): after a few steps, a step with a chunk
    costs at most about `CHUNK_COST` times the decoding row's steps again; at the model's figures alone, the same
    steps cost nearly twice that."""
    from lookahead.loop.scheduler import CHUNK_COST

    def steps_beside(learn: bool) -> list[float]:
        model = ChunkRecorder(VOCAB, logits_fn, prefill_chunk=512, watched=1, chunk_attention=4.0)
        engine = Engine(model, cost=LengthCost(), clock=model.clock)
        engine.submit(one([1, 2, 3], 300))
        for _ in range(3):
            engine.step()
        handle = engine.submit(one([(7 * i) % (VOCAB - 1) + 1 for i in range(3000)], 2))
        while engine.step() and not handle.done:
            if not learn:
                engine.scheduler.scales = {"chunk": 1.0, "decode": 1.0}
        decoding = [t for (chunk, decoding), t in zip(model.steps, model.seconds, strict=True) if chunk is None]
        beside = [t for (chunk, decoding), t in zip(model.steps, model.seconds, strict=True) if chunk and decoding]
        return [t / decoding[-1] for t in beside[10:]]  # over a decoding step's time, once it has learnt

    assert max(steps_beside(learn=True)) <= CHUNK_COST * 1.25
    assert max(steps_beside(learn=False)) > CHUNK_COST * 1.6


def test_a_chunk_may_add_to_the_step_what_decoding_steps_took_lately():
    """The chunk's allowance is priced against the larger of the cost model's figure for the decoding rows and what
    steps without a chunk took lately (`decode_seconds`): a lookahead row's real step is larger than the smallest
    step the scheduler counts it at, and pricing the chunk against that smallest step starved a long prompt."""
    from lookahead.loop.scheduler import CHUNK_COST, Scheduler

    cost = LengthCost()
    scheduler = Scheduler(MockRowModel(VOCAB, logits_fn, prefill_chunk=512), None, cost)
    small = scheduler._prefill_allowance(5, 5 * 100, 3000)
    assert cost.predict(5 + small, (500 + small * 3000) // (5 + small)) <= CHUNK_COST * cost.predict(5, 100) + 1e-12
    scheduler._lengths = [100]
    scheduler.record([RowStep.chunk(0, [1])], 0.5, {})  # a prompt chunk's step: not a decoding step's time
    assert scheduler.decode_seconds is None
    scheduler.record([RowStep(0, [1], path_step(1), [0])], 0.5, {})  # decoding steps took 0.5 s lately
    assert scheduler.decode_seconds == 0.5
    large = scheduler._prefill_allowance(5, 5 * 100, 3000)
    added = cost.predict(5 + large, (500 + large * 3000) // (5 + large)) - cost.predict(5, 100)
    assert large > 4 * small and added <= (CHUNK_COST - 1) * 0.5 + 1e-12


def test_decode_seconds_moves_a_fixed_share_of_the_way_to_each_decoding_step():
    """`decode_seconds` is a moving average: each step without a prompt chunk moves it `DECODE_RATE` (0.3) of the way
    from what it was towards that step's time, up after a slower step and down after a faster one; a chunk's step
    leaves it where it was (a mutant that moved it away from the step's time passed the test above, which records one
    decoding step only)."""
    from lookahead.loop.scheduler import DECODE_RATE, Scheduler

    assert DECODE_RATE == 0.3
    scheduler = Scheduler(MockRowModel(VOCAB, logits_fn, prefill_chunk=512), None, LengthCost())
    scheduler._lengths = [100]
    decoding = [RowStep(0, [1], path_step(1), [0])]
    seen = []
    for seconds in (0.5, 1.5, 1.5, 0.1):
        scheduler.record(decoding, seconds, {})
        seen.append(scheduler.decode_seconds)
    scheduler.record([RowStep.chunk(0, [1])], 9.0, {})
    seen.append(scheduler.decode_seconds)
    # 0.5; 0.5 + 0.3 * 1.0; 0.8 + 0.3 * 0.7; 1.01 - 0.3 * 0.91; a chunk's step: unchanged
    assert seen == pytest.approx([0.5, 0.8, 1.01, 0.737, 0.737])


def test_the_engine_benchmark_accounts_for_every_step_and_token(tiny_checkpoint):
    """bench/engine.py's closed loop on the tiny LLaMA: every token a run gives is counted in exactly one part of its
    steps (all rows decoding, a prompt chunk, fewer rows), a plain step with every row decoding feeds and gives one
    token a row, lookahead's answers are plain's, and the summary's break-even is lookahead's extra model time per
    extra token over plain's time per token."""
    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench_dir))  # its `common` and `results_page`
    try:
        spec = importlib.util.spec_from_file_location("engine_bench", bench_dir / "engine.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(bench_dir))
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    engine = engine_for(model, max_batch=2, lookahead=LookaheadConfig(), warm=False)
    rng = random.Random(0)
    prompts = [[1, 2, *TARGET[: rng.randrange(4, 12)]] for _ in range(5)]
    records = []
    for method, lookahead in ((bench.PLAIN, None), (bench.LOOKAHEAD, LookaheadConfig(warm=False))):
        got = bench.run(engine, prompts, 2, 10, lookahead, eos=[])
        assert got["tokens"] == 5 * 10
        assert sum(part["given"] for part in got["parts"].values()) == got["tokens"]
        assert got["parts"]["full"]["steps"] == got["full"]["steps"] > 0
        assert got["parts"]["chunk"]["steps"] >= 3  # every prompt's chunk: 5 prompts, at most 2 in one step
        records.append({"concurrency": 2, "method": method, **got})
    plain, ahead = records[0]["full"], records[1]["full"]
    assert plain["fed"] == plain["given"] == 2
    assert ahead["fed"] >= 2 and ahead["given"] >= 2
    assert records[1]["answers"] == records[0]["answers"]
    summary = bench.full_steps(records, 2)
    assert summary["plain_ms_per_token"] == plain["model_ms"] / 2
    if ahead["fed"] > 2:
        extra = ahead["fed"] - 2
        assert summary["extra_ms"] == (ahead["model_ms"] - plain["model_ms"]) / extra
        assert summary["break_even"] == summary["extra_ms"] / summary["plain_ms_per_token"]
        assert summary["acceptance"] == (ahead["given"] - 2) / extra
    rows = bench.full_rows([{"concurrency": 2, "full": summary}])
    assert len(rows) == 1 and len(rows[0]) == len(bench.FULL_HEADERS)
    parts = bench.parts_rows([{"concurrency": 2, "parts": bench.run_parts(records, 2)}])
    assert len(parts) == 2 and all(len(row) == len(bench.PARTS_HEADERS) for row in parts)
