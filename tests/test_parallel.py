"""Lookahead parallelism: a step divided among ranks (sub-steps against the full step's mask), and 2 and 3 gloo
processes on the tiny LLaMA giving one process's tokens and steps (greedy and seeded sampling, chains and tree,
EOS inside a step, static sub-steps, both KV syncs), a failing rank making every rank raise, refusals."""

import itertools

import pytest
import torch
from parallel_worker import spawn

from helpers import MockStepModel, decode_one, fixed, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.drafts import DraftTree, chain_trie
from lookahead.loop import full_pattern, pack_step
from lookahead.models import Llama
from lookahead.parallel.substep import split_step

PROMPT = [5, 9, 2, 7, 3, 5, 9, 2, 11, 4, 5, 9]
TOKENS = 40


def layouts():
    """Full and warm-up steps of both forms, with shared candidate prefixes and a deep tree branch."""
    levels = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
    chains = full_pattern(LookaheadConfig(5, 4, 3, form="chains"))
    tree = DraftTree.from_parents([1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, -1, 3, -1, 5])
    yield "chains", pack_step(levels, chain_trie([(1, 2, 3), (1, 4, 5), (9, 9, 9)]), chains, False)
    yield "chains-warmup", pack_step(levels[:2], chain_trie([(1, 2), (1, 4)]), chains, False)
    yield "chains-none", pack_step(levels, chain_trie([]), chains, False)
    yield "tree", pack_step(levels, tree, full_pattern(LookaheadConfig(5, 4, 3)), False)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5], ids=lambda k: f"K{k}")
def test_sub_steps_see_what_the_full_step_sees(ranks):
    """Each rank's sub-step, a tree pattern, gives its tokens the full step's visibility restricted to them and the
    full step's relative positions; padding is seen by no real token; every real step index is owned by exactly one
    rank, inside its sub-step."""
    for name, layout in layouts():
        full = layout.pattern
        idx = torch.arange(full.num_tokens)
        visible = full.visible(idx[:, None], idx[None, :])
        split = split_step(layout, ranks)
        assert sorted(itertools.chain(*split.owned)) == layout.real_indices, name
        for rank in range(ranks):
            sub = split.sub_step(layout, rank, size=40)
            n = len(sub.indices)
            local = torch.arange(sub.pattern.num_tokens)
            seen = sub.pattern.visible(local[:, None], local[None, :])
            g = torch.tensor(sub.indices)
            assert torch.equal(seen[:n, :n], visible[g][:, g]), (name, rank)
            assert not seen[:n, n:].any(), (name, rank)  # padding leaves
            assert torch.equal(sub.pattern.relative_positions[:n], full.relative_positions[g])
            assert sub.indices[0] == 0 and sub.pattern.num_tokens == max(40, n)
            assert list(sub.tokens[:n]) == [layout.tokens[i] for i in sub.indices]
            assert set(sub.owned) <= set(sub.indices)
            if ranks > 1 and name == "chains":
                assert n < len(layout.real_indices)  # a share, not the whole step


def test_split_balances_columns_and_branches():
    _, layout = next(layouts())
    split = split_step(layout, 2)
    sizes = [len(split.sub_step(layout, rank).indices) for rank in range(2)]
    assert abs(sizes[0] - sizes[1]) <= 3 and sum(sizes) < len(layout.real_indices) + 5
    assert split.owner[0] == 0  # the input token's output is rank 0's


def test_mock_model_runs_a_sub_step():
    """The mock model rebuilds each token's context from the pattern and checks its positions: a sub-step passes."""
    _, layout = next(layouts())
    model = MockStepModel(16)
    model.prefill([1, 2, 3])
    for rank in range(3):
        sub = split_step(layout, 3).sub_step(layout, rank)
        model.step(list(sub.tokens), sub.pattern, list(range(len(sub.tokens))))
    assert decode_one(MockStepModel(16), [1, 2], 4).tokens  # the mock itself still decodes


def _cases(folder):
    """(name, generate kwargs, per-rank overrides, fail_at) and the single-process reference of each."""
    model = Llama.from_pretrained(folder)
    # full-size and cold, as lookahead parallelism runs and drafts: the single process's steps are the reference's
    configs = {"chains": LookaheadConfig(4, 4, 3, form="chains"), "tree": fixed(4, 4, 3)}
    cases, reference = [], {}

    def add(name, overrides=None, fail_at=None, expect=None, **kwargs):
        kwargs = {"prompt_ids": PROMPT, "max_new_tokens": TOKENS, "eos_token_id": [], **kwargs}
        cases.append((name, kwargs, overrides or {}, fail_at))
        if expect is None:
            plain = {k: v for k, v in kwargs.items() if k not in ("attn_backend", "warmup")}
            result = model.generate(**plain)
            expect = (result.tokens, result.steps, result.step_tokens)
        reference[name] = expect

    for form, config in configs.items():
        add(f"{form}-greedy", lookahead=config)
        add(f"{form}-sampling", lookahead=config, temperature=0.9, top_k=20, seed=7)
    add("tree-static", lookahead=configs["tree"], static_step=True)
    add("tree-static-warm", lookahead=configs["tree"], static_step=True, warmup=True,
        expect=reference["tree-static"])
    # the Triton kernel (interpreted on CPU) on padded sub-steps: the tree pattern (1, 2) of a few shapes
    add("triton-static", lookahead=configs["tree"], max_new_tokens=12, static_step=True, attn_backend="triton")
    # an EOS that arrives inside a multi-token step, not at its end
    steps = reference["tree-greedy"][2]
    step = next(s for s in steps[1:] if len(s) >= 2 and s[0] not in itertools.chain(*steps[: steps.index(s)]))
    add("tree-eos", lookahead=configs["tree"], eos_token_id=[step[0]])
    assert reference["tree-eos"][0][-1] == step[0] and reference["tree-eos"][0] != reference["tree-greedy"][0]
    fail = ("error",)
    add("fails", lookahead=configs["tree"], fail_at=(1, 3), expect=fail)
    add("differ", lookahead=configs["tree"], overrides={1: {"max_new_tokens": TOKENS - 1}}, expect=fail)
    add("refused", lookahead=configs["tree"], overrides={1: {"top_p": 2.0}}, expect=fail)  # bad on one rank only
    add("auto", lookahead="auto", expect=("per world",))  # the defaults scaled with K: checked per K below
    add("stream-fails", lookahead=configs["chains"], fail_at=(1, "stream"), expect=fail)
    add("narrow", lookahead=fixed(2, 4, 2))  # W = 2: too few columns for 3 ranks
    add("after-failures", lookahead=configs["chains"])  # the group still works
    return cases, reference


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """Every case on 2 and on 3 spawned gloo ranks (one spawn per world size)."""
    folder = str(tiny_checkpoint("gqa"))
    cases, reference = _cases(folder)
    out = {}
    for world in (2, 3):
        store = str(tmp_path_factory.mktemp(f"store{world}") / "store")
        mine = [case for case in cases if world == 2 or case[0] != "triton-static"]  # the interpreter is slow
        out[world] = spawn(world, store, folder, mine, timeout=30.0, wait=240.0)
    return out, reference


@needs_interpreter
def test_the_triton_kernel_runs_padded_sub_steps(runs):
    results, reference = runs
    assert all(out["triton-static"] == reference["triton-static"][:2] for out in results[2])


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("name", ["chains-greedy", "chains-sampling", "tree-greedy", "tree-sampling", "tree-static",
                                  "tree-eos", "after-failures"])
def test_ranks_give_one_process_tokens_and_steps(runs, world, name):
    results, reference = runs
    tokens, steps, _ = reference[name]
    for rank, out in enumerate(results[world]):
        assert out[name] == (tokens, steps), (rank, out[name])


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_a_warm_up_prepares_every_sub_step_shape(runs, world):
    """warmup(process_group=...) prepares each padded sub-step size: the static generation after it adds none."""
    results, reference = runs
    for out in results[world]:
        assert out["tree-static-warm"] == reference["tree-static"][:2]
        assert out["tree-static-warm:new shapes"] == []


def test_parallel_sampling_gives_plain_sampling(runs, tiny_checkpoint):
    """Seeded draws are keyed by position: K ranks sampling with seed 7 give what plain decoding samples with it."""
    results, reference = runs
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    plain = model.generate(PROMPT, TOKENS, temperature=0.9, top_k=20, seed=7, eos_token_id=[]).tokens
    for form in ("chains", "tree"):
        assert reference[f"{form}-sampling"][0] == plain
        assert all(out[f"{form}-sampling"][0] == plain for world in (2, 3) for out in results[world])


def test_the_references_take_multi_token_steps(runs):
    """So the accepted entries' KV really travel (broadcast)."""
    _, reference = runs
    for name in ("chains-greedy", "tree-greedy", "tree-sampling"):
        tokens, steps, _ = reference[name]
        assert len(tokens) > steps, name


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_a_failing_rank_makes_every_rank_raise(runs, world):
    results, _ = runs
    errors = [out["fails"] for out in results[world]]
    assert all(e[0] == "error" for e in errors), errors
    assert "injected failure on rank 1" in errors[1][2]
    for rank in (0, *range(2, world)):
        assert errors[rank][1] == "RuntimeError" and "rank(s) [1] failed" in errors[rank][2], errors[rank]


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_a_rank_whose_stream_raises_makes_every_rank_raise(runs, world):
    results, _ = runs
    errors = [out["stream-fails"] for out in results[world]]
    assert errors[1][:3] == ("error", "RuntimeError", "stream failed on rank 1"), errors[1]
    for rank in (0, *range(2, world)):
        assert errors[rank][1] == "RuntimeError" and "rank(s) [1] failed" in errors[rank][2], errors[rank]


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_ranks_with_different_arguments_are_refused(runs, world):
    results, _ = runs
    for out in results[world]:
        assert out["differ"][:2] == ("error", "ValueError") and "ranks [1] were called with different" \
            in out["differ"][2], out["differ"]


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_a_rank_given_a_bad_argument_makes_every_rank_raise_at_once(runs, world):
    """The ranks agree on the request before any of them acts on it: a bad argument on rank 1 alone makes every rank
    raise the same ValueError, within seconds (not the group's timeout, 30 s here)."""
    results, _ = runs
    for out in results[world]:
        assert out["refused"][:2] == ("error", "ValueError") and "rank(s) [1] refused" in out["refused"][2] \
            and "top_p must be in (0, 1]" in out["refused"][2], out["refused"]
        assert out["refused:seconds"] < 10


@pytest.mark.parametrize("world", [2, 3], ids=lambda k: f"K{k}")
def test_auto_scales_the_defaults_with_the_ranks(runs, tiny_checkpoint, world):
    """lookahead="auto" with a group is the default configuration with W and G times K (strong scaling)."""
    results, _ = runs
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    alone = model.generate(PROMPT, TOKENS, lookahead=fixed().scaled(world), eos_token_id=[])
    for out in results[world]:
        assert out["auto"] == (alone.tokens, alone.steps)


def test_a_window_narrower_than_the_ranks_is_refused(runs):
    results, reference = runs
    assert all(out["narrow"] == reference["narrow"][:2] for out in results[2])
    for out in results[3]:
        assert out["narrow"][:2] == ("error", "ValueError") and "W >= 3" in out["narrow"][2], out["narrow"]


def test_refusals_without_a_group(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        model.generate(PROMPT, 4, lookahead=LookaheadConfig(), process_group=object())


def test_scaled_is_the_papers_strong_scaling():
    config = LookaheadConfig(3, 4, 3, form="chains")
    assert config.scaled(4) == LookaheadConfig(12, 4, 12, form="chains")
