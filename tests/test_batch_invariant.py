"""The batch-invariant mode (`Llama(batch_invariant=True)`): a position's logits are bitwise equal (`torch.equal`,
never a tolerance) whatever computes them: plain steps, lookahead steps of random shapes (chains and trees), packed
beside random other rows, prompts prefilled in random chunks, prefixes from the cache."""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from test_default_model import chat_ids, dev_prompts

from helpers import RandomCost, fixed, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.kernels import StepPattern
from lookahead.kernels.block_attention import BLOCK, block_attention, path_keys, query_slots, row_keys
from lookahead.kernels.row_plans import ROW_PLANS, RowPlan, invariant_linear, invariant_matmul
from lookahead.loop import RowStep, path_step
from lookahead.models import Llama
from lookahead.models.runner import CachedRunner

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCAB = 101  # the tiny checkpoint's
TURNS = Path(__file__).resolve().parents[1] / "bench" / "data" / "dev-turn2.jsonl"


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    folder = tiny_checkpoint("gqa")
    return {dtype: Llama.from_pretrained(folder, dtype=dtype, batch_invariant=True) for dtype in DTYPES}


def plain_logits(model, sequence: list[int]) -> list[torch.Tensor]:
    """Every position's logits by one-token steps from position 0: the reference."""
    runner = CachedRunner(model, 16, max_step_tokens=1)
    row, _ = runner.admit([], len(sequence) + 1)
    logits = []
    for token in sequence:
        (out,) = runner.step([RowStep.chunk(row, [token])])
        logits.append(out.logits[0].clone())
        runner.commit(row, [0])
    return logits


def random_tree(rng: random.Random, truth: list[int], size: int) -> tuple[list[int], tuple[int, ...], list[int]]:
    """A random draft tree of about `size` nodes in pre-order holding a root-to-node path of the true next tokens:
    (tokens, tree_end, the true path's node indices)."""
    children: dict[int, list[int]] = {-1: []}
    parents, on_path, tokens = [], [], []
    depth_of = {-1: 0}
    path_end = -1  # the deepest node of the true path so far
    for j in range(size):
        if path_end + 1 == len(parents) and depth_of[path_end] < len(truth) and rng.random() < 0.6:
            parent = path_end  # extend the true path
        else:
            parent = rng.choice([-1, *range(len(parents))])
        parents.append(parent)
        children.setdefault(parent, []).append(j)
        depth_of[j] = depth_of[parent] + 1
        true = parent == path_end and depth_of[j] <= len(truth) and (parent == -1 or on_path[parent])
        true = true and not any(on_path[c] for c in children[parent][:-1])
        on_path.append(true)
        if true:
            path_end = j
        tokens.append(truth[depth_of[j] - 1] if true else rng.randrange(VOCAB))
    order = []  # pre-order of the forest

    def visit(node):
        for child in children.get(node, []):
            order.append(child)
            visit(child)

    visit(-1)
    place = {node: i for i, node in enumerate(order)}
    ends = [0] * len(order)
    for node in reversed(order):
        ends[place[node]] = max([place[node] + 1] + [ends[place[c]] for c in children.get(node, [])])
    path = sorted(place[n] for n in range(len(order)) if on_path[n])
    return [tokens[n] for n in order], tuple(ends), path


def lookahead_step(rng: random.Random, row: int, sequence: list[int], length: int, chains: bool):
    """A random lookahead step at L = `length` of `sequence` (its next tokens known): (RowStep, the committed step
    indices, which the true path's verification nodes are; their logits are positions L, L + 1, ...)."""
    window, ngram = rng.randint(1, 10), rng.randint(2, 5)
    truth = sequence[length + 1 : length + ngram]
    lookahead = [sequence[length]] + [rng.randrange(VOCAB) for _ in range(window * (ngram - 1) - 1)]
    if chains:
        guesses = rng.randint(0, 4)
        candidates = [[rng.randrange(VOCAB) for _ in range(ngram - 1)] for _ in range(guesses)]
        keep = 0
        if guesses and len(truth) == ngram - 1:
            true_at = rng.randrange(guesses)
            keep = rng.randint(0, ngram - 1)  # how much of it is right
            candidates[true_at][:keep] = truth[:keep]
        pattern = StepPattern(window, ngram, guesses)
        path = [pattern.candidate_index(true_at, k) for k in range(1, keep + 1)] if keep else []
        tokens = lookahead + [t for c in candidates for t in c]
    else:
        nodes, ends, path = random_tree(rng, truth, rng.randint(0, 20))
        pattern = StepPattern(window, ngram, 0, ends)
        path = [pattern.lookahead_len + j for j in path]
        tokens = lookahead + nodes
    verified = [0, *path]
    return RowStep(row, tokens, pattern, verified), verified


def run_schedule(model, sequence: list[int], seed: int, others: int, reference: list[torch.Tensor],
                 chunk_prefix: int) -> int:
    """Decode `sequence` by a random schedule (random prompt chunks, then random lookahead steps, packed beside
    `others` rows stepping at random; with a cached prefix when `chunk_prefix`), checking every verified position's
    logits against `reference`; returns how many positions were checked."""
    rng = random.Random(seed)
    runner = CachedRunner(model, 64, max_step_tokens=120, max_rows=others + 1)
    if chunk_prefix:  # an earlier sequence with the same first tokens leaves its full blocks cached
        first, _ = runner.admit(sequence[:chunk_prefix], chunk_prefix)
        runner.step([RowStep.chunk(first, sequence[:chunk_prefix])])
        runner.commit(first, range(chunk_prefix))
        runner.release(first)
    prompt_len = rng.randint(1, len(sequence) // 2)
    row, length = runner.admit(sequence[:prompt_len], len(sequence) + 120)
    assert length == (min(chunk_prefix, prompt_len - 1) // BLOCK * BLOCK if chunk_prefix else 0)
    side = []  # the other rows: (row, their own random sequence, L)
    for _ in range(others):
        other_seq = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 70))]
        other, _ = runner.admit([], len(other_seq) + 120)
        side.append([other, other_seq, 0])
    checked = 0
    while length < len(sequence) - 1:
        if length < prompt_len:  # a prompt chunk, every position's logits asked for
            size = rng.randint(1, prompt_len - length)
            tokens = sequence[length : length + size]
            step = RowStep(row, tokens, path_step(size), list(range(size)), prefill=True)
            committed = list(range(size))
        elif rng.random() < 0.2:  # a plain step
            step, committed = RowStep.chunk(row, [sequence[length]]), [0]
        else:
            step, committed = lookahead_step(rng, row, sequence, length, chains=rng.random() < 0.3)
            assert [step.tokens[i] for i in committed] == sequence[length : length + len(committed)]
        steps, commits = [step], [committed]
        for entry in side:  # each other row takes a plain step, a prompt chunk or a lookahead step, or sits out
            other, other_seq, other_len = entry
            if other_len >= len(other_seq) - 1 or rng.random() < 0.25:
                continue
            if rng.random() < 0.6:  # a plain step or a prompt chunk
                size = 1 if rng.random() < 0.5 else rng.randint(1, min(20, len(other_seq) - 1 - other_len))
                steps.append(RowStep.chunk(other, other_seq[other_len : other_len + size]))
                commits.append(list(range(size)))
            else:
                other_step, other_commit = lookahead_step(rng, other, other_seq, other_len, rng.random() < 0.3)
                steps.append(other_step)
                commits.append(other_commit)
        rng.shuffle(order := list(range(len(steps))))
        outputs = runner.step([steps[i] for i in order])
        out = outputs[order.index(0)]
        for k, logits in enumerate(out.logits):
            position = length + k
            assert torch.equal(logits, reference[position]), f"position {position} (seed {seed})"
            checked += 1
        for i in order:
            runner.commit(steps[i].row, commits[i])
        length += len(committed)
        lengths = {s.row: len(c) for s, c in zip(steps[1:], commits[1:], strict=True)}
        for entry in side:
            entry[2] += lengths.get(entry[0], 0)
    return checked


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("seed", range(4))
def test_every_position_is_bitwise_the_plain_steps(models, dtype, seed):
    model = models[dtype]
    rng = random.Random(seed)
    sequence = [rng.randrange(VOCAB) for _ in range(rng.randint(40, 90))]
    reference = plain_logits(model, sequence)
    checked = run_schedule(model, sequence, seed, others=seed % 3, reference=reference,
                           chunk_prefix=[0, 20, 37, 48][seed])
    assert checked >= len(sequence) // 2


def chunked_logits(model, sequence: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """Every position's logits with `sequence` fed in chunks of `sizes` (the last one takes what is left)."""
    runner = CachedRunner(model, -(-len(sequence) // 16) + 2, max_step_tokens=1)
    runner.prefill_chunk = max(sizes)
    row, _ = runner.admit([], len(sequence) + 1)
    logits, at = [], 0
    for size in [*sizes, len(sequence)]:
        chunk = sequence[at : at + size]
        if not chunk:
            break
        (out,) = runner.step([RowStep(row, chunk, path_step(len(chunk)), list(range(len(chunk))), prefill=True)])
        logits += [position.clone() for position in out.logits]
        runner.commit(row, list(range(len(chunk))))
        at += len(chunk)
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_6k_token_prompt_is_bitwise_the_same_whole_chunked_or_decoded(tiny_checkpoint, dtype):
    """At 6,144 positions a position's logits are the same bits whether its prompt came whole (one step), in the
    chunks the scheduler picks beside busy rows (large first, then ever smaller as the cache grows, down to one
    token), or in fixed 512-token chunks: the scheduler's chunk size is a matter of time only."""
    model = Llama.from_pretrained(tiny_checkpoint("long", max_position_embeddings=8192), dtype=dtype,
                                  batch_invariant=True)
    rng = random.Random(6144)
    sequence = [rng.randrange(VOCAB) for _ in range(6144)]
    whole = chunked_logits(model, sequence, [6144])
    shrinking = [512, 300, 97, *[rng.choice([1, 2, 5, 16, 33]) for _ in range(400)]]
    for sizes in ([512] * 12, shrinking):
        logits = chunked_logits(model, sequence, sizes)
        assert len(logits) == len(sequence)
        different = [i for i, (a, b) in enumerate(zip(logits, whole, strict=True)) if not torch.equal(a, b)]
        assert not different, f"{len(different)} positions differ from the whole prompt's, the first {different[:1]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16bit_greedy_and_seeded_sampling_lookahead_equal_plain(models, dtype):
    """What a user sees: in 16-bit, lookahead (full-size and random self-tuned steps) and a batch give plain decoding's
    tokens, greedy and seeded sampling alike."""
    model = models[dtype]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 11}):
        plain = [model.generate(p, max_new_tokens=40, eos_token_id=[], **sampling).tokens for p in prompts]
        for i, prompt in enumerate(prompts):
            assert model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=fixed(4, 4, 6),
                                  **sampling).tokens == plain[i]
            model.cost_model = RandomCost(i)
            assert model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=LookaheadConfig(warm=False),
                                  **sampling).tokens == plain[i]
        if not sampling:
            batch = model.generate(prompts, max_new_tokens=40, eos_token_id=[], lookahead=fixed(2, 3, 4))
            assert [r.tokens for r in batch] == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_without_the_cpu_kernel_torch_gemms_through_row_plans_are_invariant_too(tiny_checkpoint, monkeypatch, dtype):
    """Where the CPU GEMM cannot be compiled, the mode falls back to torch's GEMMs through verified row plans."""
    from lookahead.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda build_dir=None: False)
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype=dtype, batch_invariant=True)
    rng = random.Random(9)
    sequence = [rng.randrange(VOCAB) for _ in range(60)]
    reference = plain_logits(model, sequence)
    assert run_schedule(model, sequence, 9, others=2, reference=reference, chunk_prefix=33) >= 30
    assert not model.uses_cpu_kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_steps_layers_in_one_call_give_the_bits_of_the_layers_one_by_one(models, monkeypatch, dtype):
    """With the CPU kernels a packed step runs in one call from its ids to its logits (`cpu_kernels.decoder_step`):
    every position's logits, over random schedules (chunks, trees, padding, rows beside), are bitwise what the ops
    give run one by one from Python (the embedding, the layers, the final norm and the head)."""
    from lookahead.kernels import cpu_kernels
    from lookahead.models.invariant import InvariantOps

    model = models[dtype]
    assert model.uses_cpu_kernels, "the CPU kernels did not build here"
    rng = random.Random(21)
    sequence = [rng.randrange(VOCAB) for _ in range(70)]
    monkeypatch.setattr(InvariantOps, "whole_step", False)
    reference = plain_logits(model, sequence)
    calls, real = [], cpu_kernels.decoder_step
    monkeypatch.setattr(InvariantOps, "whole_step", True)
    monkeypatch.setattr(cpu_kernels, "decoder_step", lambda *args: calls.append(args[0].shape) or real(*args))
    assert run_schedule(model, sequence, 21, others=2, reference=reference, chunk_prefix=20) >= 35
    assert len(calls) > 20 and len({shape[0] for shape in calls}) > 5  # it ran, over many step sizes


def test_the_step_in_one_call_sees_weights_written_or_replaced(tiny_checkpoint, monkeypatch):
    """The one call keeps its weights between steps: a weight written in place (a layer's, the final norm's, the
    embedding's), or a parameter replaced, reaches its next step as it reaches the ops run one by one."""
    from lookahead.models.invariant import InvariantOps

    model = Llama.from_pretrained(tiny_checkpoint("gqa"), batch_invariant=True)
    prompt, tokens = list(range(1, 14)), []

    def generate_both_ways():
        monkeypatch.setattr(InvariantOps, "whole_step", False)
        one_by_one = model.generate(prompt, max_new_tokens=16, eos_token_id=[]).tokens
        monkeypatch.setattr(InvariantOps, "whole_step", True)
        tokens.append(model.generate(prompt, max_new_tokens=16, eos_token_id=[]).tokens)
        assert tokens[-1] == one_by_one

    generate_both_ways()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-4)
    generate_both_ways()
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight.detach() * 3)
    generate_both_ways()
    with torch.no_grad():
        model.model.norm.weight.mul_(-1)
    generate_both_ways()
    with torch.no_grad():
        model.model.embed_tokens.weight[1:14].mul_(-2)  # the prompt's rows
    generate_both_ways()
    assert all(a != b for a, b in itertools.pairwise(tokens)), tokens


@pytest.mark.parametrize("built", [True, False], ids=["built", "not-built"])
def test_whether_the_cpu_kernels_run_has_one_answer(tiny_checkpoint, monkeypatch, built):
    """`invariant.runs_cpu_kernels` is the one answer to "do the package's CPU kernels run this model": made to say no
    (or left to say yes), the mode's linears and norms, the runner's attention, the layers in one call, the cost key
    and the default dtype all follow it (a GGUF load too: test_gguf.py). A second place answering it (asking the
    build itself, or the device and the attention's type) would run a kernel that the answer refused, or skip one."""
    from lookahead.kernels import cpu_kernels
    from lookahead.models import invariant, placement, tuning

    assert invariant.cpu_kernels_built(), f"the CPU kernels did not build here: {cpu_kernels.failure()}"
    monkeypatch.setattr(invariant, "cpu_kernels_built", lambda: built)
    calls = []
    for name in ("gemm", "rms_norm", "attention", "decoder_step"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype=torch.float32, batch_invariant=True)
    assert model.uses_cpu_kernels is built
    tokens = model.generate(list(range(1, 30)), max_new_tokens=12, lookahead=LookaheadConfig(3, 3, 2, budget="fixed"),
                            eos_token_id=[]).tokens
    assert model.runner.backend.kernel == ("cpu" if built else "torch")
    assert set(calls) == ({"decoder_step"} if built else set())  # the whole step: its norms and GEMMs inside
    assert (tuning.cost_key(model, model.runner)["kernels"] is not None) is built
    monkeypatch.setattr(invariant.InvariantOps, "whole_step", False)  # the layers one by one: the kernel's attention
    calls.clear()
    model.release()
    assert model.generate(list(range(1, 30)), max_new_tokens=12, lookahead=LookaheadConfig(3, 3, 2, budget="fixed"),
                          eos_token_id=[]).tokens == tokens
    assert ("attention" in calls) is built and ("decoder_step" in calls) is False
    model.batch_invariant = False  # the mode off: the model does not run on them, whatever the build
    assert not model.uses_cpu_kernels
    monkeypatch.delenv("LOOKAHEAD_DTYPE")
    monkeypatch.setattr(placement, "bf16_dot_products", lambda: "avx512_bf16")
    assert placement.default_dtype(torch.device("cpu"), batch_invariant=True)[0] == (
        torch.bfloat16 if built else torch.float32)


@pytest.mark.parametrize("family, whole", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_layers_with_biases_or_qk_norms_run_one_by_one(tiny_checkpoint, family, whole):
    """`decoder_step` computes LLaMA's layers only: a model with q/k/v biases (Qwen2) or q/k norms (Qwen3) runs its
    own, one by one."""
    from lookahead.models.attention import KeyLists, Paged
    from lookahead.models.kv_cache import KVPool, KVShape

    extra = {"head_dim": 32} if family == "qwen3" else {}
    model = Llama.from_pretrained(tiny_checkpoint(family, family=family, **extra), batch_invariant=True)
    cfg = model.config
    pool = KVPool(KVShape.of(cfg), 1, 16, model.dtype, "cpu")
    one = torch.zeros(1, dtype=torch.int64)  # one token at slot 0, seeing itself
    attend = Paged(pool, one, KeyLists("cpu", one, one[None], one + 1))
    ids, positions = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    out = model._invariant_ops.decoder_step(model.model, model.lm_head, ids, positions, model.rope_inv_freq, attend,
                                            None)
    assert (out is not None) == whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the mode on CUDA needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_every_position_is_bitwise_the_plain_steps_on_cuda(tiny_checkpoint, dtype, backend):
    """The first thing a GPU must show: the mode holds there too (cuBLAS GEMMs through verified row plans, the Triton
    kernel or the torch path for attention)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype=dtype, device="cuda", attn_backend=backend,
                                  batch_invariant=True)
    for seed in range(3):
        rng = random.Random(seed)
        sequence = [rng.randrange(VOCAB) for _ in range(rng.randint(40, 90))]
        reference = plain_logits(model, sequence)
        assert run_schedule(model, sequence, seed, others=2, reference=reference, chunk_prefix=[0, 20, 37][seed]) > 0


def test_the_mode_off_differs_somewhere(tiny_checkpoint):
    """The negative control: without the mode, 16-bit logits of one position differ between a one-token step and a
    many-token step (so the tests above can fail)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype=torch.bfloat16, batch_invariant=False)
    rng = random.Random(0)
    sequence = [rng.randrange(VOCAB) for _ in range(64)]
    reference = plain_logits(model, sequence)
    runner = CachedRunner(model, 16, max_step_tokens=64)
    row, _ = runner.admit(sequence, 65)
    (out,) = runner.step([RowStep(row, sequence, path_step(64), list(range(64)), prefill=True)])
    assert any(not torch.equal(out.logits[p], reference[p]) for p in range(64))


def test_the_mode_is_a_property_that_drops_the_runner(tiny_checkpoint):
    assert Llama.from_pretrained(tiny_checkpoint("gqa")).batch_invariant  # a CPU's default
    assert not Llama.from_pretrained(tiny_checkpoint("gqa"), fusion="compile").batch_invariant  # fused: off
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), batch_invariant=False)
    assert not model.batch_invariant
    model.generate([1, 2, 3], max_new_tokens=2)
    assert model.runner is not None
    model.batch_invariant = True
    assert model.runner is None and model.batch_invariant
    with pytest.raises(TypeError, match="batch_invariant"):
        model.batch_invariant = 1
    with pytest.raises(ValueError, match="fusion"):
        Llama.from_pretrained(tiny_checkpoint("gqa"), batch_invariant=True, fusion="compile")


# ----- the pieces -----

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_invariant_linear_rows_do_not_depend_on_the_rows_beside_them(dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 48).to(dtype)
    x = torch.randn(70, 48).to(dtype)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight) for i in range(70)])
    for m in (2, 3, 5, 17, 33, 70):
        assert torch.equal(invariant_linear(x[:m], weight), alone[:m])


def test_a_plan_pads_and_cuts_rows():
    calls = []

    def gemm(chunk):
        calls.append(chunk.shape[0])
        return chunk * 2

    x = torch.arange(22.0)[:, None]
    assert torch.equal(RowPlan(4, 8).apply(gemm, x), x * 2)
    assert calls == [8, 8, 8]  # 8, 8 and 6 rows padded to 8
    assert ROW_PLANS[-1] == RowPlan(1, 1)  # the plan that holds by construction comes last


def test_matmul_rows_do_not_depend_on_the_rows_beside_them():
    torch.manual_seed(1)
    keys = torch.randn(3, 5, BLOCK, 16)
    q = torch.randn(3, 1, 40, 16)
    full = invariant_matmul(q, keys.transpose(-1, -2), "scores")
    for m in (1, 2, 3, 7, 21):
        assert torch.equal(invariant_matmul(q[:, :, :m], keys.transpose(-1, -2), "scores"), full[:, :, :m])


def test_block_attention_matches_sdpa_and_does_not_depend_on_the_step():
    """A query's output through the shared route (a path) equals its output as a tree node whose ancestors sit
    elsewhere in the step, bitwise; both are SDPA's within float32 rounding."""
    torch.manual_seed(2)
    heads, kv_heads, dim, n = 4, 2, 16, 45
    k = torch.randn(kv_heads, n + 10, dim)
    v = torch.randn(kv_heads, n + 10, dim)
    q = torch.randn(n, heads, dim)
    keys = path_keys(0, n, lambda p: p, "cpu")
    out = block_attention(q, k, v, keys)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k[:, :n], v[:, :n], attn_mask=mask,
                                                            enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    # the query at position 40 as node 3 of a step at L = 37 whose nodes 0, 2 and 3 are positions 37, 38, 39 and 40,
    # the step's slots 50..53 holding those positions' keys (slot 51 a stranger's)
    k2, v2 = k.clone(), v.clone()
    for slot, position in ((50, 37), (52, 38), (53, 39), (54, 40)):
        k2[:, slot], v2[:, slot] = k[:, position], v[:, position]
    k2[:, 51] = torch.randn(kv_heads, dim)
    visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
                           dtype=torch.bool)

    def slot_of(positions):
        return torch.where(positions < 37, positions, positions - 37 + 50)

    tree = row_keys(37, visible, slot_of, 0, "cpu")
    q2 = torch.stack([q[37], q[0], q[38], q[39], q[40]])
    out2 = block_attention(q2, k2, v2, tree)
    for i, position in ((0, 37), (2, 38), (3, 39), (4, 40)):
        assert torch.equal(out2[i], out[position])


# ----- the default model in bfloat16 -----

def dev_conversations(count: int) -> list[list[str]]:
    rows = [json.loads(line) for line in TURNS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["turns"] for row in rows[:count]]


def bf16_prompts(folder, count: int) -> list[list[int]]:
    prompts = [p for kind in ("chat", "code", "math") for p in dev_prompts((kind,))[:4]]  # short: prefill is cheap
    assert len(prompts) >= count
    return [chat_ids(folder, text) for text in prompts[:count]]


@pytest.mark.slow
def test_bf16_lookahead_batches_and_cached_prefixes_equal_plain_greedy(default_model_dir):
    """The promise in bfloat16 on the default model: lookahead with full-size and self-tuned steps (random step sizes:
    every size the budget can choose), a batch of 4 and a second turn with its prefix cached each give plain greedy's
    tokens, token for token."""
    model = Llama.from_pretrained(default_model_dir, dtype=torch.bfloat16, batch_invariant=True)
    prompts = bf16_prompts(default_model_dir, 12)
    plain = [model.generate(ids, max_new_tokens=32, eos_token_id=[]).tokens for ids in prompts]
    for i, ids in enumerate(prompts):
        fixed_steps = model.generate(ids, max_new_tokens=32, eos_token_id=[], lookahead=fixed())
        assert fixed_steps.tokens == plain[i], f"prompt {i}, fixed steps"
        model.cost_model = RandomCost(i)
        tuned = model.generate(ids, max_new_tokens=32, eos_token_id=[], lookahead=LookaheadConfig(warm=False))
        assert tuned.tokens == plain[i], f"prompt {i}, self-tuned steps"
    batch = model.generate(prompts[:4], max_new_tokens=32, eos_token_id=[], lookahead=fixed())
    assert [r.tokens for r in batch] == plain[:4]
    for turns in dev_conversations(3):  # a second turn: cached from the first's blocks, then cold
        first = chat_ids(default_model_dir, turns[0])
        answer = model.generate(first, max_new_tokens=16, eos_token_id=[]).tokens
        second = first + answer + chat_ids(default_model_dir, turns[1])
        cached = model.generate(second, max_new_tokens=16, eos_token_id=[], lookahead=fixed())
        assert cached.cached_tokens > 0
        model.release()
        cold = model.generate(second, max_new_tokens=16, eos_token_id=[])
        assert cold.cached_tokens == 0 and cached.tokens == cold.tokens


@pytest.mark.slow
def test_bf16_without_the_mode_lookahead_differs_somewhere(default_model_dir):
    """The negative control of the test above: the same prompts in bfloat16 with the mode off give plain greedy's
    tokens on some prompts only (so the test above can fail)."""
    model = Llama.from_pretrained(default_model_dir, dtype=torch.bfloat16, batch_invariant=False)
    prompts = bf16_prompts(default_model_dir, 12)
    assert any(model.generate(ids, max_new_tokens=64, eos_token_id=[], lookahead=fixed()).tokens
               != model.generate(ids, max_new_tokens=64, eos_token_id=[]).tokens for ids in prompts)


# ----- the Triton kernel (under the interpreter on a CPU) -----

@needs_interpreter  # CPU tensors: on a CUDA host ..._plain_steps_on_cuda[triton-*] runs the kernel
def test_the_triton_kernel_agrees_with_block_attention_and_with_itself():
    """`invariant_attention` to rounding against `block_attention`; a query's output bitwise the same computed alone,
    among other queries and with its slot list padded wider."""
    from lookahead.kernels.block_attention import query_slots
    from lookahead.kernels.invariant_triton import invariant_attention

    torch.manual_seed(3)
    heads, kv_heads, dim, n = 4, 2, 16, 37
    k, v, q = torch.randn(kv_heads, n + 5, dim), torch.randn(kv_heads, n + 5, dim), torch.randn(n, heads, dim)
    keys = path_keys(0, n, lambda p: p, "cpu")
    slots, counts = query_slots(keys, n)
    out = invariant_attention(q, k, v, slots, counts)
    torch.testing.assert_close(out, block_attention(q, k, v, keys), rtol=1e-5, atol=1e-5)
    for i in (0, 15, 16, 36):
        alone = invariant_attention(q[i : i + 1], k, v, slots[i : i + 1], counts[i : i + 1])
        assert torch.equal(alone, out[i : i + 1])
        wider = torch.nn.functional.pad(slots[i : i + 1], (0, 2 * BLOCK))
        assert torch.equal(invariant_attention(q[i : i + 1], k, v, wider, counts[i : i + 1]), out[i : i + 1])


@needs_interpreter  # a CPU model: on a CUDA host test_every_position_is_bitwise_the_plain_steps_on_cuda runs it
def test_every_position_is_bitwise_the_plain_steps_with_the_triton_kernel(tiny_checkpoint):
    """The model-level check of the Triton backend's mode, float32 (the interpreter's bf16 is wrong)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="triton", batch_invariant=True)
    rng = random.Random(7)
    sequence = [rng.randrange(VOCAB) for _ in range(34)]
    reference = plain_logits(model, sequence)
    assert run_schedule(model, sequence, 7, others=1, reference=reference, chunk_prefix=20) >= 17


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_cpu_kernels_compute_what_torch_computes(dtype):
    """The compiled CPU GEMM and attention against torch to rounding (the invariance tests above hold each only to
    itself), and a query's attention bitwise the same alone and among others."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(4)
    weight, x = torch.randn(100, 70).to(dtype), torch.randn(9, 70).to(dtype)  # a model's rows are in its dtype
    torch.testing.assert_close(cpu_kernels.gemm(x, cpu_kernels.pack(weight)), x.float() @ weight.float().T, rtol=1e-5,
                               atol=1e-4)
    # query i sees keys 0..i: consecutive queries share their first keys, so the kernel reads those once for a run of
    # queries, with the run's rows in vector lanes (`rows_in_lanes`) where a run has 6 rows or more and head sizes
    # are 16s, else with the keys in lanes (`keys_in_lanes`), the same arithmetic: a query alone takes the second
    # where its run took the first (2 and 3 heads per KV head), or the first where it has 6 heads per KV head; 300
    # keys span two of the first's key tiles; head sizes in and out of 16s
    for heads, kv_heads, dim, n in ((4, 2, 16, 37), (9, 3, 64, 45), (6, 1, 24, 20), (12, 2, 32, 300)):
        k, v = torch.randn(kv_heads, n + 5, dim).to(dtype), torch.randn(kv_heads, n + 5, dim).to(dtype)
        q = torch.randn(n, heads, dim)
        slots, counts = query_slots(path_keys(0, n, lambda p: p, "cpu"), n)
        out = cpu_kernels.attention(q, k, v, slots, counts)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k[:, :n].float(), v[:, :n].float(), attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out, sdpa.to(out.dtype), rtol=1e-5, atol=1e-5)
        for i in range(n):
            assert torch.equal(cpu_kernels.attention(q[i : i + 1], k, v, slots[i : i + 1], counts[i : i + 1]),
                               out[i : i + 1]), (heads, kv_heads, dim, i)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_step_without_layers_is_its_embedding_final_norm_and_head(dtype):
    """`cpu_kernels.decoder_step` around its layers: the embedding's rows read from the weight or from a packed copy
    of it (a tied head's, released: `Llama.keep_weights_once`), the rows asked for, normed and through the head, each
    logit rounded to the dtype: bitwise the ops one by one (`embedding`, `rms_norm`, `gemm`). A token id outside the
    vocabulary is an IndexError, not a read past the table."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(5)
    vocab, hidden = 70, 24  # 70 rows: two column blocks, the second padded
    embedding, head, norm = (torch.randn(vocab, hidden).to(dtype), torch.randn(vocab, hidden).to(dtype),
                             torch.rand(hidden).to(dtype) + 0.5)
    ids, rows = torch.tensor([3, 69, 0, 64, 3, 41]), torch.tensor([5, 0, 3])
    empty = torch.zeros(0, 1, 8, 4, dtype=dtype)  # no layers: no cache
    none = torch.zeros(0, dtype=torch.int64)
    cos = torch.zeros(1, len(ids), 1, 4, dtype=dtype)
    want = cpu_kernels.gemm(cpu_kernels.rms_norm(embedding[ids][rows], norm, 1e-5), cpu_kernels.pack(head)).to(dtype)

    def step(table, ids=ids):
        return cpu_kernels.decoder_step(ids, table, cos, cos, [[norm], [cpu_kernels.pack(head).blocks]], empty, empty,
                                        ids, none, none[:, None], none, rows, 1, 1, 1, vocab, 1e-5)

    for table in (embedding, cpu_kernels.pack(embedding).blocks):
        assert torch.equal(step(table)[0], want)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        step(embedding, torch.tensor([3, 70, 0, 1, 2, 4]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_steps_argmax_and_top_k_are_torchs(dtype):
    """`cpu_kernels.top_ids` (what a step fetches: each row's argmax, then its top k) against torch's argmax and topk:
    the same argmax (the first largest; NaN above every number), the same top-k values, and among equal values (a
    16-bit row has many) the lower id first."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(6)
    logits = (torch.randn(7, 300) * 3).round().to(dtype)  # rounded: many ties, the largest among them
    logits[2, 5], logits[2, 40], logits[3] = float("nan"), float("nan"), float("-inf")
    logits[4, 299] = 100.0  # the largest last
    for k in (0, 1, 8, 300):
        got = cpu_kernels.top_ids(logits, k)
        assert torch.equal(got[:7], logits.argmax(-1))
        top = got[7:].view(7, k)
        torch.testing.assert_close(logits.gather(1, top), logits.topk(k, dim=-1).values, rtol=0, atol=0,
                                   equal_nan=True)
        for row, ids in zip(logits, top.tolist(), strict=True):
            ranked = sorted(range(row.numel()), key=lambda i: (not row[i].isnan(), -row[i].float().nan_to_num(), i))
            assert ids == ranked[:k]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_modes_silu_is_torchs_to_its_roundings(dtype):
    """`cpu_kernels.silu_mul` (the mode's SiLU(gate) * up, with the package's own exp) against float64's
    SiLU(gate) * up, both rounded as `F.silu(gate) * up` rounds: to a few float32 ulp, and where the exp's error could
    flip a 16-bit rounding, to one step of the dtype; over gates where the exp over- and underflows and at +-0, rows
    of a width no multiple of the lanes' 16, each row's bits the same alone."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(8)
    gate = torch.cat([torch.randn(5, 37) * 4, torch.tensor([-200.0, -88.0, -87.0, -20.0, -0.0, 0.0, 1e-30, 20.0,
                                                            88.0, 200.0] + [1.0] * 27)[None]]).to(dtype)
    up = torch.randn(6, 37).to(dtype)
    got = cpu_kernels.silu_mul(gate, up)
    g = gate.double()
    reference = ((g / (1 + torch.exp(-g))).to(dtype).double() * up.double()).to(dtype)
    step = 1e-6 if dtype == torch.float32 else {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(got.double(), reference.double(), rtol=2 * step, atol=1e-30)
    assert torch.equal(torch.signbit(got), torch.signbit(reference))  # -0 * up keeps its sign as torch's does
    for r in range(6):
        assert torch.equal(cpu_kernels.silu_mul(gate[r : r + 1], up[r : r + 1]), got[r : r + 1])
    with pytest.raises(RuntimeError, match="gate and up differ"):
        cpu_kernels.silu_mul(gate, up[:, :36])


def test_bf16_dot_products_compute_each_output_as_a_chain_over_pairs_of_k():
    """Where the CPU has bf16 dot products the build uses them (AVX512-BF16's vdpbf16ps), and a bfloat16 GEMM's output
    is exactly the chain the kernel documents: over pairs of k in order, from zero, the odd k's product added before
    the even one's, each addition rounded (the products of two bfloat16 are exact in float32). Emulated in torch,
    bitwise, for an odd K (its last pair padded with zeros) and every row count a tile takes."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    assert cpu_kernels.pairs() == (cpu_kernels.bf16_dot_products() in ("amx_bf16", "avx512_bf16"))
    if not cpu_kernels.pairs():
        pytest.skip("this CPU has no AVX512-BF16: its bfloat16 GEMM widens to float32 (the test above covers it)")
    torch.manual_seed(6)
    k = 71
    weight, x = torch.randn(130, k).to(torch.bfloat16), torch.randn(13, k).to(torch.bfloat16)
    out = cpu_kernels.gemm(x, cpu_kernels.pack(weight))
    xs, ws = torch.nn.functional.pad(x.float(), (0, 1)), torch.nn.functional.pad(weight.float(), (0, 1))
    chain = torch.zeros(13, 130)
    for even in range(0, k + 1, 2):
        chain = chain + xs[:, even + 1, None] * ws[None, :, even + 1]
        chain = chain + xs[:, even, None] * ws[None, :, even]
    assert torch.equal(out, chain)
    for rows in range(1, 8):  # one row to a tile and more: the same bits
        assert torch.equal(cpu_kernels.gemm(x[:rows], cpu_kernels.pack(weight)), out[:rows])
    widened = cpu_kernels.pack(weight, widen=True)  # the widening path's layout, on this CPU too (bench/cpu_gemm.py)
    assert widened.blocks.dim() == 3
    torch.testing.assert_close(cpu_kernels.gemm(x, widened), x.float() @ weight.float().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_widening_gemm_computes_each_output_as_a_chain_of_fused_multiply_adds(dtype):
    """Float32 rows times float32 weights, or bfloat16 ones widened (every CPU without bf16 dot products): each output
    is exactly the chain the kernel documents, over k in order from zero, each step one fused multiply-add (emulated
    in float64, where a product of two float32 is exact, then rounded to float32). For every row count a tile takes
    (the AVX2 tiles take up to 3 rows and split more), a K past the AVX2 tiles' chunk of 64 and a partial column
    block (100 = 64 + 36)."""
    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(7)
    weight, x = torch.randn(100, 70).to(dtype), torch.randn(13, 70)
    packed = cpu_kernels.pack(weight, widen=True)
    out = cpu_kernels.gemm(x, packed)
    xs, ws = x.double(), weight.double()
    chain = torch.zeros(13, 100)
    for k in range(70):
        chain = (xs[:, k, None] * ws[None, :, k] + chain.double()).float()
    assert torch.equal(out, chain)
    for rows in range(1, 13):
        assert torch.equal(cpu_kernels.gemm(x[:rows], packed), out[:rows])
        assert torch.equal(cpu_kernels.gemm(x[rows:], packed), out[rows:])


def test_the_cpu_gemm_benchmark_runs_quick():
    """bench/cpu_gemm.py --quick: every implementation at every shape, the dot products' row where this CPU has them."""
    import subprocess
    import sys

    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    bench = Path(__file__).resolve().parents[1] / "bench" / "cpu_gemm.py"
    done = subprocess.run([sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    header, *rows = [line for line in done.stdout.splitlines() if "|" in line and not line.startswith("-")]
    assert ("kernel bf16 (dot products)" in header) == cpu_kernels.pairs()
    assert "kernel fp32" in header and "torch F.linear bf16" in header
    assert len(rows) == 8 and {row.split("|")[0].strip() for row in rows} == {"q/k/v", "gate/up", "down", "logits"}


def _kernel_outputs(x, packed, q, k, v, slots, counts) -> tuple[torch.Tensor, torch.Tensor]:
    from lookahead.kernels import cpu_kernels

    return cpu_kernels.gemm(x, packed), cpu_kernels.attention(q, k, v, slots, counts)


def test_the_cpu_kernels_give_the_same_bits_on_any_threads_and_after_a_fork():
    """The kernels' own threads claim a call's items as they come (a busy machine leaves more to the caller): the bits
    are the same with one thread or two, from several Python threads at once (one call runs on its caller alone
    while another has the workers), and in a forked child (which has none of its parent's workers)."""
    import concurrent.futures
    import signal

    from lookahead.kernels import cpu_kernels

    assert cpu_kernels.available()
    torch.manual_seed(5)
    x, packed = torch.randn(7, 96), cpu_kernels.pack(torch.randn(2000, 96).to(torch.bfloat16))  # 32 column blocks
    n = 50
    q, k, v = torch.randn(n, 4, 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    slots, counts = query_slots(path_keys(0, n, lambda p: p, "cpu"), n)
    args = (x, packed, q, k, v, slots, counts)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _kernel_outputs(*args)
        torch.set_num_threads(2)
        for _ in range(20):
            assert all(map(torch.equal, _kernel_outputs(*args), alone))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for got in pool.map(lambda _: _kernel_outputs(*args), range(30)):
                assert all(map(torch.equal, got, alone))
        child = os.fork()
        if child == 0:  # the child compares and says so in its exit status (2: a hang, killed below)
            os._exit(0 if all(map(torch.equal, _kernel_outputs(*args), alone)) else 1)
        deadline = time.monotonic() + 60
        while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended[0] == 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        assert ended[0] == child and os.waitstatus_to_exitcode(ended[1]) == 0, "the forked child hung or differed"
    finally:
        torch.set_num_threads(threads)
