"""Static steps (padded to the configuration's full size) give the tokens of exact-size steps; the layout
owner packs them; imports point one way; CUDA graphs (GPU only) replay the eager step exactly."""

import random

import pytest
import torch
from test_pattern import random_parents

from helpers import MockStepModel, RandomCost, context_logits, decode_one, fixed, grow_from, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.drafts import DraftBuilder, DraftTree, chain_trie
from lookahead.kernels import StepPattern
from lookahead.loop import full_pattern, pack_step
from lookahead.loop.verify import Verdict
from lookahead.models import Llama

CONFIGS = [(1, 2, 0), (1, 2, 3), (3, 2, 3), (4, 3, 0), (1, 4, 2), (3, 4, 3), (5, 4, 5), (15, 5, 15)]
IDS = [f"W{w}-N{n}-G{g}" for w, n, g in CONFIGS]
TARGET = [7, 3, 9, 12, 4, 8, 1, 11, 5, 14, 6, 10, 13] * 6


def test_static_layout_pads_where_no_real_token_looks():
    full = full_pattern(fixed(3, 4, 2))
    levels = [[10, 11, 12], [20, 21, 22]]  # warm-up: 2 of 3 levels
    tree = chain_trie([(5, 6)])  # a warm-up candidate of 2 tokens
    layout = pack_step(levels, tree, full, static=True)
    assert layout.pattern.shape == full.shape and len(layout.tokens) == full.num_tokens == 15
    assert layout.tokens[:6] == [10, 11, 12, 20, 21, 22]
    assert layout.tokens[9:11] == [5, 6]  # the candidate's path, then padding leaves
    assert [layout.rows[r] for r in layout.last_level_rows] == [3, 4, 5]
    assert len(layout.rows) == 1 + 3 + 2 * 3  # the same row count at every step of a static generation
    padding = [*range(6, 9), *range(11, 15)]
    real = [i for i in range(full.num_tokens) if i not in padding]
    mask = layout.pattern.materialize(0)
    assert not mask[real][:, padding].any()  # no real token sees a padding token
    exact = pack_step(levels, tree, full, static=False)
    assert exact.pattern == StepPattern(3, 3, tree_end=(2, 2)) and exact.tokens == [10, 11, 12, 20, 21, 22, 5, 6]
    verdict = Verdict([5, 6, 9], 1)
    assert layout.commit_indices(verdict) == [0, 9, 10] and exact.commit_indices(verdict) == [0, 6, 7]


@pytest.mark.parametrize("W, N, G", CONFIGS, ids=IDS)
def test_mock_static_equals_exact_size(W, N, G):
    for seed in range(3):
        prompt = torch.randint(0, 16, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        exact = decode_one(MockStepModel(16), prompt, 40, lookahead=fixed(W, N, G))
        model = MockStepModel(16)
        static = decode_one(model, prompt, 40, lookahead=fixed(W, N, G), static_step=True)
        assert static.tokens == exact.tokens and static.step_tokens == exact.step_tokens
        # one shape, warm-up included (a tree's structure is data, not shape)
        assert {p.shape for p in model.patterns} == {full_pattern(fixed(W, N, G)).shape}
        model = MockStepModel(16)
        chains = fixed(W, N, G, form="chains")
        static = decode_one(model, prompt, 40, lookahead=chains, static_step=True)
        assert static.tokens == exact.tokens
        assert {p.shape for p in model.patterns} == {full_pattern(chains).shape}  # the same shape as the tree's


@pytest.mark.parametrize("limit", [1, 5, 9])
def test_static_steps_stop_at_eos_and_limit_inside_a_step(limit):
    vocab = 16
    fn = lambda ctx: context_logits(ctx, vocab, target=[1, 2] + TARGET)  # noqa: E731
    cfg = fixed(4, 5, 4)
    prompt = [1, 2] + TARGET[:8]
    exact = decode_one(MockStepModel(vocab, fn), prompt, limit, lookahead=cfg)
    static = decode_one(MockStepModel(vocab, fn), prompt, limit, lookahead=cfg, static_step=True)
    assert static.tokens == exact.tokens == TARGET[8 : 8 + limit]
    eos = 12
    exact = decode_one(MockStepModel(vocab, fn), prompt, 60, stop=[eos], lookahead=cfg)
    static = decode_one(MockStepModel(vocab, fn), prompt, 60, stop=[eos], lookahead=cfg, static_step=True)
    assert static.tokens == exact.tokens and static.tokens[-1] == eos and len(static.step_tokens[-1]) > 1


@pytest.mark.parametrize("W, N, G", CONFIGS, ids=IDS)
def test_tiny_llama_static_equals_exact_and_plain(tiny_checkpoint, W, N, G):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    for seed in range(2):
        prompt = torch.randint(0, 101, (3 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = model.generate(prompt, max_new_tokens=40, eos_token_id=[])
        cfg = fixed(W, N, G)
        exact = model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=cfg, static_step=False)
        static = model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=cfg, static_step=True)
        assert static.tokens == exact.tokens == plain.tokens
        assert static.steps == exact.steps


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)], ids=["T1", "T0.7-p0.9"])
def test_tiny_llama_static_sampling_equals_exact(tiny_checkpoint, temperature, top_p):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompt = [3, 17, 22, 3, 17, 5, 9]
    cfg = fixed(3, 4, 3)
    for seed in range(3):
        kwargs = dict(max_new_tokens=32, eos_token_id=[], lookahead=cfg, temperature=temperature, top_p=top_p,
                      seed=seed)
        exact = model.generate(prompt, static_step=False, **kwargs)
        static = model.generate(prompt, static_step=True, **kwargs)
        assert static.tokens == exact.tokens and static.steps == exact.steps


@needs_interpreter
@pytest.mark.parametrize("W, N, G", [(1, 2, 0), (3, 4, 3)], ids=["W1-N2-G0", "W3-N4-G3"])
def test_triton_backend_static_steps(tiny_checkpoint, W, N, G):
    folder = tiny_checkpoint("gqa")
    reference = Llama.from_pretrained(folder, attn_backend="torch")
    kernel = Llama.from_pretrained(folder, attn_backend="triton")
    prompt = [3, 17, 22, 3, 17, 5, 9]
    plain = reference.generate(prompt, max_new_tokens=20, eos_token_id=[])
    cfg = fixed(W, N, G)
    result = kernel.generate(prompt, max_new_tokens=20, eos_token_id=[], lookahead=cfg, static_step=True)
    assert result.tokens == plain.tokens


def test_runner_is_reused_across_generations(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = fixed(3, 4, 3)
    first = model.generate([1, 2, 3], max_new_tokens=10, lookahead=cfg, eos_token_id=[])
    runner = model.runner
    again = model.generate([1, 2, 3], max_new_tokens=10, lookahead=cfg, eos_token_id=[])
    plain = model.generate([4, 5], max_new_tokens=10, eos_token_id=[])
    assert model.runner is runner and again.tokens == first.tokens
    assert plain.tokens == model.generate([4, 5], max_new_tokens=10, eos_token_id=[], static_step=True).tokens
    model.generate([1, 2, 3], max_new_tokens=400, lookahead=cfg, eos_token_id=[])  # needs a larger cache: grown
    assert model.runner is runner and runner.capacity == 512 and not runner.rows


def test_full_pattern_is_the_configured_budget():
    for form in ("chains", "tree"):
        assert full_pattern(fixed(15, 5, 15, form=form)).num_tokens == 120
        assert full_pattern(fixed(3, 4, 0, form=form)).max_commit == 1
    assert full_pattern(fixed(3, 4, 3, form="chains")).max_commit == 4
    assert full_pattern(fixed(3, 4, 3, form="tree")).max_commit == 10  # a path may use all 9 nodes


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@cuda
@pytest.mark.parametrize("lookahead", [None, fixed(3, 4, 3), fixed(7, 5, 7)],
                         ids=["plain", "W3-N4-G3", "W7-N5-G7"])
def test_cuda_graphs_replay_the_eager_step(tiny_checkpoint, lookahead):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), device="cuda", dtype=torch.float32)
    prompt = [3, 17, 22, 3, 17, 5, 9]
    kwargs = dict(max_new_tokens=48, eos_token_id=[], lookahead=lookahead, static_step=True)
    eager = model.generate(prompt, cuda_graph=False, **kwargs)
    graphed = model.generate(prompt, cuda_graph=True, **kwargs)
    again = model.generate(prompt, cuda_graph=True, **kwargs)  # replays the graphs captured above
    assert graphed.tokens == eager.tokens == again.tokens
    runner = model.runner
    assert runner.cuda_graphs and all(p.graph is not None for p in runner.programs.values())
    cpu = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert graphed.tokens == cpu.generate(prompt, max_new_tokens=48, eos_token_id=[]).tokens


@cuda
@pytest.mark.parametrize("lookahead", [None, fixed(3, 4, 3), fixed(3, 4, 3, form="chains")],
                         ids=["plain", "W3-N4-G3", "W3-N4-G3-chains"])
def test_cuda_graphs_sample_as_the_eager_step(tiny_checkpoint, lookahead):
    """Sampling reads the graph's logits and its staged seeds and positions after the replay: same seed, same tokens,
    and those of the CPU's plain sampling (the keys are a hash of seed and position on any device)."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), device="cuda", dtype=torch.float32)
    kwargs = dict(max_new_tokens=48, eos_token_id=[], temperature=0.8, top_p=0.95, seed=3)
    eager = model.generate([3, 17, 22, 3, 17, 5, 9], cuda_graph=False, lookahead=lookahead, static_step=True, **kwargs)
    graphed = model.generate([3, 17, 22, 3, 17, 5, 9], cuda_graph=True, lookahead=lookahead, static_step=True, **kwargs)
    assert graphed.tokens == eager.tokens and graphed.steps == eager.steps
    cpu = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert graphed.tokens == cpu.generate([3, 17, 22, 3, 17, 5, 9], **kwargs).tokens


class KernelLaunches:
    """Wraps a Triton kernel global and records the compile-time (keyword) arguments of every launch."""

    def __init__(self, kernel):
        self.kernel, self.constexpr_sets = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.constexpr_sets.append(tuple(sorted(kwargs.items())))
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_interpreter
@pytest.mark.parametrize("form", ["chains", "tree"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "exact-size"])
def test_a_static_generation_compiles_the_kernel_once(tiny_checkpoint, monkeypatch, static, form):
    """7-4-7 (a smaller 15-5-15: the interpreter's time grows with the step) launches the kernel with one set of
    compile-time arguments, warm-up included, also when every step brings another tree: W, N, T and the tree are
    run-time values. Exact-size steps (N grows during the warm-up, T with every draft) share it too in fp32, whose
    tiles do not depend on T (16-bit ones change across 16..128 rows)."""
    import lookahead.kernels.triton_attention as kernel_module

    launches = KernelLaunches(kernel_module._lookahead_attn_split)
    monkeypatch.setattr(kernel_module, "_lookahead_attn_split", launches)
    if form == "tree":  # another random tree every step, of any size up to the budget
        rng = random.Random(0)

        def random_tree(sequence, pool, budget, levels=0):
            size = rng.randint(0, budget)
            return DraftTree.from_parents([rng.randrange(101) for _ in range(size)], random_parents(size, rng))

        monkeypatch.setattr(DraftBuilder, "grow", grow_from(random_tree))
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="triton")
    prompt = [3, 17, 22, 3, 17, 5, 9, 3, 17]
    result = model.generate(prompt, max_new_tokens=8, eos_token_id=[], lookahead=fixed(7, 4, 7, form=form),
                            static_step=static)
    assert result.steps >= 5  # the 3 warm-up steps and at least one full one
    # every forward pass runs the kernel, the prompt's too (a prompt chunk is a row of a packed step)
    assert len(launches.constexpr_sets) == result.steps * model.config.num_hidden_layers
    assert model.dtype == torch.float32 and len(set(launches.constexpr_sets)) == 1, set(launches.constexpr_sets)


def test_warmup_prepares_the_runner_the_generation_uses(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = fixed(3, 4, 3)
    model.warmup(cfg, max_tokens=300, static_step=True)
    runner = model.runner
    prepared = set(runner.step_shapes)
    assert runner.capacity >= 300 and prepared == set(runner.decode_shapes(1, full_pattern(cfg).num_tokens, 8))
    result = model.generate(list(range(1, 40)), max_new_tokens=200, lookahead=cfg, eos_token_id=[], static_step=True)
    assert model.runner is runner and set(runner.step_shapes) == prepared  # nothing met mid-generation
    assert result.tokens == model.generate(list(range(1, 40)), max_new_tokens=200, eos_token_id=[]).tokens
    with pytest.raises(ValueError, match="max_tokens must be an int >= 2"):
        model.warmup(cfg, max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens .* exceeds the model's max_position_embeddings"):
        model.warmup(cfg, max_tokens=10**6)


def test_warmup_prepares_every_shape_of_a_batch(tiny_checkpoint):
    """Rows finish and join: a warm-up for up to 3 rows prepares every shape their decoding steps can take (greedy or
    sampling alike: sampling draws after the step), so the generations after it prepare nothing new."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    cfg = LookaheadConfig(2, 3, 2)
    model.warmup(cfg, max_tokens=64, batch=3, sampling=True, static_step=True)
    prepared = set(model.runner.step_shapes)
    assert {shape.rows for shape in prepared} == {1, 2, 4} and {shape.topk for shape in prepared} == {8}
    prompts = [[5, 6, 7], [9, 8], [3, 4, 5, 6]]
    reference = Llama.from_pretrained(tiny_checkpoint("gqa"))
    plain = [reference.generate(p, max_new_tokens=12, eos_token_id=[]).tokens for p in prompts]
    eos = [plain[0][3]]  # row 0 finishes early: the batch shrinks
    model.cost_model = RandomCost(4)  # every size of step
    model.generate(prompts, max_new_tokens=12, eos_token_id=eos, lookahead=cfg, static_step=True)
    model.generate(prompts, max_new_tokens=12, lookahead=cfg, temperature=0.8, seed=1, static_step=True)
    model.generate(prompts[0], max_new_tokens=12, lookahead=cfg, static_step=True, temperature=0.8, seed=1)
    model.generate(prompts[1], max_new_tokens=12, lookahead=cfg, static_step=True)
    assert set(model.runner.step_shapes) == prepared
