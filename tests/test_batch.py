"""Batches: several prompts decoded together, each row exactly as that prompt alone (mock model, tiny LLaMA on
both backends, the default model), finished rows leaving the batch, per-row seeds, refusals."""

import pytest
import torch

from helpers import (
    MockRowModel,
    MockStepModel,
    RandomCost,
    context_logits,
    decode_one,
    decode_rows,
    fixed,
    needs_interpreter,
)
from lookahead import LookaheadConfig
from lookahead.kernels import StepPattern
from lookahead.loop import full_pattern
from lookahead.models import Llama
from lookahead.request import SamplingParams, row_seeds
from lookahead.tuning import CostModel, Curve

CONFIGS = [None, (1, 2, 0), (3, 4, 3), (5, 4, 5), (2, 5, 3)]
IDS = ["plain" if c is None else "W{}-N{}-G{}".format(*c) for c in CONFIGS]
TARGET = [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 6  # each token determines the next
PLAIN = StepPattern(1, 2, 0)


def ragged_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1 + (5 * i) % 11,), generator=generator).tolist() for i in range(count)]


def early_eos(outputs: list[list[int]], at: int = 4) -> tuple[int, int]:
    """(token, length): a token that ends the first row's output after `length` >= at + 1 tokens (its first
    occurrence there); other rows end where they first hold it, or not at all."""
    first = outputs[0]
    index = next(i for i in range(at, len(first)) if first[i] not in first[:i])
    return first[index], index + 1


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("known", [False, True], ids=["random", "known-text"])
def test_mock_batch_equals_each_prompt_alone(config, known):
    """Ragged prompts, an EOS that ends some rows early: every row's tokens and steps are its own decode's."""
    vocab = 32
    fn = (lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)) if known else None  # noqa: E731
    prompts = ragged_prompts(5, vocab)
    if known:  # rows that follow the known text (many tokens a step) beside rows that do not
        prompts[1], prompts[3] = [1, 2] + TARGET[:6], [1, 2] + TARGET[:13]
    lookahead = LookaheadConfig(*config) if config else None
    plain = [decode_one(MockStepModel(vocab, fn), p, 40).tokens for p in prompts]
    token, length = early_eos(plain)
    eos = [token]
    alone = [decode_one(MockStepModel(vocab, fn), p, 40, lookahead=lookahead, stop=eos) for p in prompts]
    model = MockRowModel(vocab, fn)
    batch = decode_rows(model, prompts, 40, lookahead=lookahead, stop=eos)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.step_tokens for r in batch] == [r.step_tokens for r in alone]
    assert len(batch[0].tokens) == length and batch[0].tokens[-1] == token
    full = PLAIN if lookahead is None else full_pattern(lookahead)
    assert {p.shape for p in model.patterns} == {full.shape}  # static steps: one shape, warm-up included
    assert model.batch_sizes == sorted(model.batch_sizes, reverse=True)
    assert model.batch_sizes[0] == len(prompts) and model.batch_sizes[-1] < len(prompts)  # finished rows left
    assert len(model.batch_sizes) == max(r.steps for r in batch)  # one forward per step for all rows, prefill too
    if known and lookahead is not None and lookahead.guesses:
        assert batch[3].compression > 1.5, batch[3].compression



def test_finished_rows_leave_the_batch():
    vocab = 32
    prompts = ragged_prompts(4, vocab, seed=3)
    plain = [decode_one(MockStepModel(vocab), p, 30).tokens for p in prompts]
    eos = [plain[2][1]]  # row 2 ends after its second token; rows whose output lacks it run to the limit
    cfg = LookaheadConfig(3, 4, 3)
    model = MockRowModel(vocab)
    batch = decode_rows(model, prompts, 30, lookahead=cfg, stop=eos)
    assert [r.tokens for r in batch] == [decode_one(MockStepModel(vocab), p, 30, lookahead=cfg, stop=eos).tokens
                                         for p in prompts]
    assert len(batch[2].tokens) == 2 and model.batch_sizes[2] < 4  # gone after its first step (step 0: prefills)


def test_two_rows_leave_at_once_and_rows_of_different_lengths_move_into_their_places(tiny_checkpoint):
    """Rows 0 and 1 finish at the same step; rows 2 and 3, whose caches hold different lengths, move down into their
    places (one copy of each mover's cache, up to its own L). Every row must still decode as it does alone."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompts = [[49, 97, 53], [5, 33, 65, 62], [51, 100, 38, 61, 45, 74, 27, 64, 17, 36, 17, 96, 12, 79], [32, 68]]
    plain = [model.generate(p, max_new_tokens=20, eos_token_id=[]).tokens for p in prompts]
    end = next(k for k in range(2, 12)  # a step k at which rows 0 and 1 can both stop, and nothing else stops
               if plain[0][k] not in plain[0][:k] and plain[1][k] not in plain[1][:k]
               and not {plain[0][k], plain[1][k]} & {*plain[0][:k], *plain[1][:k], *plain[2], *plain[3]})
    eos = [plain[0][end], plain[1][end]]
    batch = model.generate(prompts, max_new_tokens=20, eos_token_id=eos)
    assert [len(r.tokens) for r in batch] == [end + 1, end + 1, 20, 20]
    assert [r.tokens for r in batch] == [p[: len(r.tokens)] for p, r in zip(plain, batch, strict=True)]


def test_rows_done_at_prefill_never_step():
    prompts = ragged_prompts(3, 16)
    model = MockRowModel(16)
    results = decode_rows(model, prompts, 1, lookahead=LookaheadConfig())
    assert [len(r.tokens) for r in results] == [1, 1, 1] and model.batch_sizes == [3]  # the prefills only


def test_stream_gets_each_rows_tokens():
    prompts = ragged_prompts(3, 16)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    results = decode_rows(MockRowModel(16), prompts, 12, lookahead=LookaheadConfig(),
                           stream=lambda row, tokens: seen[row].extend(tokens))
    assert [seen[i] for i in range(3)] == [r.tokens for r in results]


@pytest.mark.parametrize("config", [None, (3, 4, 3), (4, 3, 0)], ids=["plain", "W3-N4-G3", "W4-N3-G0"])
def test_tiny_llama_batch_equals_each_prompt_alone(tiny_checkpoint, config):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompts = ragged_prompts(4, 101, seed=1)
    lookahead = fixed(*config) if config else None  # full-size and cold: the same steps alone and batched
    plain = [model.generate(p, max_new_tokens=24, eos_token_id=[]).tokens for p in prompts]
    eos, length = early_eos(plain, at=6)
    alone = [model.generate(p, max_new_tokens=24, eos_token_id=eos, lookahead=lookahead) for p in prompts]
    batch = model.generate(prompts, max_new_tokens=24, eos_token_id=eos, lookahead=lookahead)
    assert isinstance(batch, list) and [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.steps for r in batch] == [r.steps for r in alone]
    assert len(batch[0].tokens) == length and max(len(r.tokens) for r in batch) > length
    runner = model.runner
    assert not runner.rows and runner.blocks.held == 0 and not runner.step_shapes  # exact-size steps on a CPU
    static = model.generate(prompts, max_new_tokens=24, eos_token_id=eos, lookahead=lookahead, static_step=True)
    assert [r.tokens for r in static] == [r.tokens for r in alone]  # padded to a few shapes, the same tokens
    assert {shape.rows for shape in runner.step_shapes} == {1, 2, 4}  # 4 rows, then fewer as they finish
    # a batch of one, tensors as rows, and the model's runner reused for a single prompt afterwards
    assert [r.tokens for r in model.generate([torch.tensor(prompts[2])], max_new_tokens=24, eos_token_id=eos,
                                             lookahead=lookahead)] == [alone[2].tokens]
    single = model.generate(prompts[1], max_new_tokens=24, eos_token_id=eos, lookahead=lookahead)
    assert single.tokens == alone[1].tokens


@needs_interpreter
def test_triton_backend_batch(tiny_checkpoint):
    """The kernel with per-row prefix lengths [b] under the interpreter: one small ragged batch."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="triton")
    reference = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="torch")
    prompts = [[3, 17, 22, 3, 17, 5, 9], [8, 1]]
    expected = [reference.generate(p, max_new_tokens=8, eos_token_id=[]).tokens for p in prompts]
    batch = model.generate(prompts, max_new_tokens=8, eos_token_id=[], lookahead=LookaheadConfig(2, 3, 2))
    assert [r.tokens for r in batch] == expected


@pytest.mark.parametrize("config", [None, (3, 4, 3)], ids=["plain", "W3-N4-G3"])
def test_sampling_rows_are_their_own(tiny_checkpoint, config):
    """Row i with seed s samples the same tokens whatever its neighbours, and as its prompt alone with seed s."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    p0, p1, p2, p3 = ragged_prompts(4, 101, seed=2)
    kwargs = dict(max_new_tokens=20, eos_token_id=[], temperature=1.0, top_p=0.95,
                  lookahead=LookaheadConfig(*config) if config else None)
    first = model.generate([p0, p1, p2], seed=[10, 11, 12], **kwargs)
    again = model.generate([p0, p1, p2], seed=[10, 11, 12], **kwargs)
    other = model.generate([p3, p1], seed=[99, 11], **kwargs)
    alone = model.generate(p1, seed=11, **kwargs)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert first[1].tokens == other[1].tokens == alone.tokens
    assert first[0].tokens != first[2].tokens
    derived = model.generate([p2, p0], seed=12, **kwargs)  # an int seed s: row i gets s + i
    assert derived[0].tokens == first[2].tokens and derived[1].tokens == model.generate(p0, seed=13, **kwargs).tokens


def test_mock_sampling_rows_do_not_touch_each_other():
    vocab = 16
    prompts = ragged_prompts(3, vocab)
    sampling = SamplingParams(temperature=1.0)
    cfg = LookaheadConfig(3, 4, 3)
    batch = decode_rows(MockRowModel(vocab), prompts, 30, sampling, cfg, seeds=[5, 6, 7])
    for prompt, seed, row in zip(prompts, [5, 6, 7], batch, strict=True):
        assert decode_one(MockStepModel(vocab), prompt, 30, sampling, cfg, seed=seed).tokens == row.tokens


def test_row_seeds():
    assert row_seeds(None, 2) == (None, None) and row_seeds(7, 3) == (7, 8, 9) and row_seeds([4, 1], 2) == (4, 1)
    assert row_seeds(2**64 - 1, 2) == (2**64 - 1, 0)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_ids=[]), ValueError, "prompt_ids is empty: give one prompt"),
    (dict(prompt_ids=[[1, 2], []]), ValueError, r"prompt_ids\[1\] is empty"),
    (dict(prompt_ids=[[1, 2], 3]), TypeError, r"prompt_ids mixes token ids and prompts \(prompt_ids\[1\] is the int 3"),
    (dict(prompt_ids=[[1, 2], "ab"]), TypeError, r"prompt_ids\[1\] must be a list of ints or a 1-D integer tensor"),
    (dict(prompt_ids=[[1, 2], [3, 2.0]]), TypeError, r"prompt_ids\[1\] must be a list of ints .* found float 2.0"),
    (dict(prompt_ids=[[1, 2], {"input_ids": [1]}]), TypeError, r"prompt_ids\[1\] must be a list of ints or a 1-D"),
    (dict(prompt_ids=[torch.zeros(2, 2, dtype=torch.long)]), ValueError, r"prompt_ids\[0\] must be a 1-D"),
    (dict(prompt_ids=[[1], [7, 500]]), ValueError, r"prompt_ids\[1\] holds token id\(s\) \[500\] outside"),
    (dict(prompt_ids=[[1], [2]], seed=[1]), ValueError, "seed holds 1 seeds for 2 prompts"),
    (dict(prompt_ids=[[1], [2]], seed=[1, -2]), ValueError, r"seed\[1\] must be an int in \[0, 2\*\*64\), got -2"),
    (dict(prompt_ids=[[1], [2]], seed="7"), TypeError, "seed must be an int, a list of ints"),
    (dict(prompt_ids=[1, 2], seed=[1]), TypeError, "seed must be an int or None for one prompt"),
    (dict(prompt_ids=[[1], [2]], lookahead="fast"), TypeError, "lookahead must be None, 'auto' or a LookaheadConfig"),
    (dict(prompt_ids=[[1], list(range(1, 100)) * 6]), ValueError, r"prompt_ids\[1\] \(594 tokens\) \+ max_new"),
])
def test_batch_rejects_bad_input(tiny_checkpoint, kwargs, error, message):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    with pytest.raises(error, match=message):
        model.generate(max_new_tokens=4, **kwargs)


def test_auto_lookahead_sizes_every_step_by_the_cost_model(tiny_checkpoint):
    """"auto" is the device's maxima with self-tuned steps: a cost model where nothing pays gives plain steps, in
    one prompt and in a batch, with plain decoding's tokens."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    curve = Curve([1, 64], [1.0, 1000.0], [0.0, 0.0])  # a step of 2 tokens costs 16 one-token steps
    model.cost_model = CostModel({"greedy": curve})
    one = model.generate([5, 6, 7], max_new_tokens=6, lookahead="auto", eos_token_id=[])
    assert one.tokens == model.generate([5, 6, 7], max_new_tokens=6, eos_token_id=[]).tokens and one.steps == 6
    rows = model.generate([[5, 6, 7], [8, 9]], max_new_tokens=6, lookahead="auto", eos_token_id=[])
    assert all(r.step_sizes == [1] * 5 for r in rows)
    model.cost_model = CostModel({"greedy": Curve([1, 64], [1.0, 1.0], [0.0, 0.0])})  # every size costs the same
    rows = model.generate([[5, 6, 7, 5, 6, 7], [8, 9]], max_new_tokens=12, lookahead="auto", eos_token_id=[])
    assert max(size for r in rows for size in r.step_sizes) > 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@cuda
def test_cuda_graphs_per_batch_size(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), device="cuda", dtype=torch.float32)
    prompts = ragged_prompts(3, 101)
    kwargs = dict(max_new_tokens=24, eos_token_id=[3], lookahead=LookaheadConfig(3, 4, 3))
    eager = model.generate(prompts, cuda_graph=False, **kwargs)
    graphed = model.generate(prompts, cuda_graph=True, **kwargs)
    cpu = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert [r.tokens for r in graphed] == [r.tokens for r in eager] == [
        cpu.generate(p, **kwargs).tokens for p in prompts]


@pytest.mark.slow
def test_default_model_batch_equals_each_prompt_alone(default_model_dir):
    """Plain and lookahead batches of ragged chat prompts, one row ending early at an extra EOS: each row is
    plain greedy decoding of its prompt alone, cut at its first EOS."""
    from transformers import AutoTokenizer

    model = Llama.from_pretrained(default_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = ["What is 7 times 8?", "Write a Python function that reverses a string.",
             "List three colors of the rainbow, one per line, and nothing else."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in texts]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    plain = [model.generate(p, max_new_tokens=20, eos_token_id=[]).tokens for p in prompts]
    token, length = early_eos(plain, at=6)
    eos = [*model.config.eos_token_id, token]  # row 0 ends early; the others where they first hold one
    alone = [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in plain]
    assert len(alone[0]) == length and max(map(len, alone)) > length
    for lookahead in (None, LookaheadConfig()):
        batch = model.generate(prompts, max_new_tokens=20, eos_token_id=eos, lookahead=lookahead)
        assert [r.tokens for r in batch] == alone, lookahead
    model.cost_model = RandomCost(3)  # every row its own random size, every step
    batch = model.generate(prompts, max_new_tokens=20, eos_token_id=eos, lookahead=LookaheadConfig())
    assert [r.tokens for r in batch] == alone and len({s for r in batch for s in r.step_sizes}) > 2


@pytest.mark.parametrize("budget", ["fixed", "auto"])
def test_tiny_llama_batch_tokens_under_both_budgets(tiny_checkpoint, budget):
    """Issue 28 item 10: the batch under full-size steps and under self-tuned ones (sized by random costs, so every
    size is met): each row's tokens are its plain greedy tokens, rows leaving at their own EOS."""
    from helpers import RandomCost

    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompts = ragged_prompts(4, 101, seed=2)
    plain = [model.generate(p, max_new_tokens=20, eos_token_id=[]).tokens for p in prompts]
    eos, _ = early_eos(plain, at=5)
    expected = [tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in plain]
    model.cost_model = RandomCost(4)
    batch = model.generate(prompts, max_new_tokens=20, eos_token_id=eos,
                           lookahead=LookaheadConfig(3, 4, 3, budget=budget, warm=False))
    assert [r.tokens for r in batch] == expected
    assert max(max(r.step_sizes) for r in batch) > 1
