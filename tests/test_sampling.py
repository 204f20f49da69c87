"""Sampling with lookahead keeps the target distribution (exact enumeration vs many seeded samples), and with a seed
gives plain sampling's tokens exactly: draws are keyed by position, not by step."""

import itertools

import pytest
import torch

import lookahead.loop.core as engine
import lookahead.loop.sampling as sampling
from helpers import (
    MockRowModel,
    MockStepModel,
    RandomCost,
    context_logits,
    decode_one,
    decode_rows,
    flat_cost,
    needs_interpreter,
)
from lookahead import LookaheadConfig, SamplingParams
from lookahead.drafts import ROOT
from lookahead.loop.sampling import position_keys, sample_positions, target_probs
from lookahead.loop.verify import Verdict
from lookahead.models import Llama

VOCAB = 6
PROMPT = [0, 1, 2, 3, 4, 5, 0, 2, 4, 1, 3, 5, 0, 3, 1, 4, 2, 5, 1, 0, 5, 2, 3, 4, 0]  # every token starts n-grams
DEPTH = 3
P_FLOOR = 1e-4  # seeded, so deterministic; a correct rule fails a check with probability 1e-4 (~100 checks here)


def exact_joint(logits_fn, prompt, params, depth=DEPTH):
    """{continuation: probability} over all V**depth continuations, from the model's own logits."""
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=depth):
        p = 1.0
        for i, token in enumerate(seq):
            p *= target_probs(logits_fn(prompt + list(seq[:i]))[None].float(), params)[0, token].item()
            if p == 0:
                break
        joint[seq] = p
    return joint


def chi_square_stat(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 are pooled into one."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
            continue
        stat, df = stat + (counts.get(cell, 0) - e) ** 2 / e, df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
    return stat, max(df, 0)


def p_value(stat: float, df: int) -> float:
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square p-value; cells expected below 5 are pooled into one."""
    return p_value(*chi_square_stat(counts, expected, n))


def conditional_p(counts: dict, joint: dict, position: int) -> float:
    """Token `position` given the tokens before it: one chi-square summed over the prefixes seen.

    A wrong rule skews the verified tokens differently after each prefix; the marginal averages those skews
    away and the joint spreads the samples over V**DEPTH cells, so this is the check with the power.
    """
    expected: dict = {}
    observed: dict = {}
    for seq, p in joint.items():
        cells = expected.setdefault(seq[:position], {})
        cells[seq[position]] = cells.get(seq[position], 0.0) + p
    for seq, c in counts.items():
        cells = observed.setdefault(seq[:position], {})
        cells[seq[position]] = cells.get(seq[position], 0) + c
    stat, df = 0.0, 0
    for prefix, cells in observed.items():
        mass = sum(expected[prefix].values())
        s, d = chi_square_stat(cells, {t: p / mass for t, p in expected[prefix].items()}, sum(cells.values()))
        stat, df = stat + s, df + d
    return p_value(stat, df)


def marginal(joint: dict, position: int) -> dict:
    out: dict = {}
    for seq, p in joint.items():
        out[(seq[position],)] = out.get((seq[position],), 0.0) + p
    return out


def sample_many(make_model, params, n, cfg=None, tuned=False):
    """tuned: each run's steps sized by a random cost model (`RandomCost`), so every kind of step size is met."""
    cfg = cfg or LookaheadConfig(3, 3, 3)
    counts: dict = {}
    multi_token_runs = 0
    for seed in range(n):
        result = decode_one(make_model(), PROMPT, DEPTH, params, lookahead=cfg, stop=(), seed=seed,
                            cost=RandomCost(seed) if tuned else None)
        seq = tuple(result.tokens)
        counts[seq] = counts.get(seq, 0) + 1
        multi_token_runs += any(len(s) > 1 for s in result.step_tokens)
    return counts, multi_token_runs / n


def distribution_p_values(counts, joint, n):
    checks = {"joint": chi_square_p(counts, joint, n)}
    for position in range(DEPTH):
        observed = {}
        for seq, c in counts.items():
            observed[(seq[position],)] = observed.get((seq[position],), 0) + c
        checks[f"token{position + 1}"] = chi_square_p(observed, marginal(joint, position), n)
        if position > 0:
            checks[f"token{position + 1}-given-prefix"] = conditional_p(counts, joint, position)
    return checks


PARAMS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.9)]
# G = 6 keeps up to 6 candidates per first token: several distinct tokens compete at a position, so a rule
# that mishandles rejections (no renormalisation of the residual) is caught in every setting, not in one. The
# tree form walks Algorithm 4 down a tree whose nodes have up to 8 children (the recycled top-k).
SHAPES = [(3, 3, 3), (2, 4, 6)]
SETTINGS = ["T1", "T0.7", "T1-topk3", "T0.7-topp0.9"]  # PARAMS' names


def paired(setting: int, form: str) -> LookaheadConfig:
    """The shape a sampling setting meets in `form`: chains at one shape and the tree at the other, alternating with
    the setting, so that each shape meets each form twice."""
    return LookaheadConfig(*SHAPES[(setting + (form == "tree")) % 2], form=form)


# each sampling setting with both forms and each configuration with two settings: 8 of the 16 pairings, each 2,000
# generations (about 8 s)
PAIRS = [pytest.param(params, cfg, id=f"{name}-W{cfg.window}-N{cfg.ngram}-G{cfg.guesses}-{cfg.form}")
         for i, (name, params) in enumerate(zip(SETTINGS, PARAMS, strict=True))
         for cfg in (paired(i, "chains"), paired(i, "tree"))]


@pytest.mark.parametrize("params, cfg", PAIRS)
def test_lookahead_sampling_matches_exact_distribution(params, cfg):
    fn = lambda ctx: context_logits(ctx, VOCAB)  # noqa: E731
    joint = exact_joint(fn, PROMPT, params)
    n = 2000
    counts, accepted = sample_many(lambda: MockStepModel(VOCAB, fn), params, n, cfg)
    assert accepted > 0.2, f"only {accepted:.0%} of runs accepted a candidate token: verification barely exercised"
    checks = distribution_p_values(counts, joint, n)
    assert min(checks.values()) > P_FLOOR, checks


def accept_first_path(tree, chosen):
    """A wrong acceptance rule, the negative controls' (also tests/test_warm.py): the tree's first path, unchecked."""
    node, tokens = ROOT, []
    while (child := next(tree.children(node), None)) is not None:
        node = child
        tokens.append(tree.tokens[child])
    return Verdict(tokens + [chosen[node + 1]], node)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["T1", "T0.7"])
def test_self_tuned_sampling_matches_exact_distribution(params):
    """Steps of every size (plain, a bare tree, part of the tree, buckets), chosen at random per step."""
    fn = lambda ctx: context_logits(ctx, VOCAB)  # noqa: E731
    n = 2000
    counts, accepted = sample_many(lambda: MockStepModel(VOCAB, fn), params, n, LookaheadConfig(2, 4, 6), tuned=True)
    assert accepted > 0.2, f"only {accepted:.0%} of runs accepted a candidate token: verification barely exercised"
    checks = distribution_p_values(counts, exact_joint(fn, PROMPT, params), n)
    assert min(checks.values()) > P_FLOOR, checks


@pytest.mark.parametrize("form", ["chains", "tree", "tree-self-tuned"])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, form):
    """Negative control: always accepting the first candidate's tokens (the trie's or tree's first path) must be
    caught, with full-size and with self-tuned steps."""
    monkeypatch.setattr(engine, "verify", accept_first_path)
    params = SamplingParams(1.0)
    fn = lambda ctx: context_logits(ctx, VOCAB)  # noqa: E731
    n = 2000
    cfg = LookaheadConfig(3, 3, 3, form=form.removesuffix("-self-tuned"))
    counts, _ = sample_many(lambda: MockStepModel(VOCAB, fn), params, n, cfg, tuned=form.endswith("tuned"))
    checks = distribution_p_values(counts, exact_joint(fn, PROMPT, params), n)
    assert checks["joint"] < P_FLOOR, checks


def test_tiny_llama_sampling_matches_exact_distribution(tiny_checkpoint):
    """The same check through the real model, KV cache and commit path."""
    model = Llama.from_pretrained(tiny_checkpoint("vocab6", vocab_size=VOCAB, hidden_size=32, num_attention_heads=2,
                                                  num_key_value_heads=1, intermediate_size=48))
    model.cost_model = flat_cost()  # multi-token steps whatever the machine's load (the acceptance floor below)
    fn = lambda ctx: model(torch.tensor([ctx]))[0, -1].double()  # noqa: E731
    params = SamplingParams(1.0)
    joint = exact_joint(fn, PROMPT, params)
    n = 1200
    counts: dict = {}
    accepted = 0
    for seed in range(n):
        result = model.generate(PROMPT, max_new_tokens=DEPTH, temperature=1.0, seed=seed, eos_token_id=[],
                                lookahead=LookaheadConfig(3, 3, 6))
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        accepted += any(len(s) > 1 for s in result.step_tokens)
    assert accepted / n > 0.2
    checks = distribution_p_values(counts, joint, n)
    assert min(checks.values()) > P_FLOOR, checks


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_tiny_llama_seeded_lookahead_sampling_gives_seeded_plain_sampling(tiny_checkpoint, backend):
    """Through the real model, its runner and both attention backends: one prompt (exact-size and static steps) and
    a batch give, token for token, what plain sampling gives with the same seeds."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend=backend)
    model.cost_model = flat_cost()  # multi-token steps whatever the machine's load (checked below)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9], [4, 5, 6, 4, 5, 6]]
    if backend == "triton":  # the interpreter is slow: fewer, shorter generations
        prompts = prompts[:2]
    args = dict(max_new_tokens=20 if backend == "torch" else 10, temperature=0.8, top_k=20, eos_token_id=[])
    plain = [model.generate(p, seed=7 + i, **args).tokens for i, p in enumerate(prompts)]
    for static in (False, True) if backend == "torch" else (True,):
        for i, prompt in enumerate(prompts):
            result = model.generate(prompt, seed=7 + i, lookahead=LookaheadConfig(3, 3, 3), static_step=static,
                                    **args)
            assert result.tokens == plain[i], (static, i)
    batch = model.generate(prompts, seed=7, lookahead=LookaheadConfig(), **args)  # row i: seed 7 + i
    assert [r.tokens for r in batch] == plain and sum(len(r.tokens) - r.steps for r in batch) > 0


def test_target_probs_filters_like_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.allclose(target_probs(logits, SamplingParams(1.0)), logits.exp())
    top2 = target_probs(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    top_p = target_probs(logits, SamplingParams(1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8 <= 0.85: three tokens
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    cooled = target_probs(logits, SamplingParams(0.5))
    assert torch.allclose(cooled, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-9], ids=lambda p: f"top_p{p:g}")
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    """A top_p below float32's range rounds to 0: the top token must stay, so the draw is the argmax (greedy)."""
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.15, 0.05]]))
    assert target_probs(logits, SamplingParams(1.0, top_p=top_p)).tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]
    model = MockStepModel(VOCAB)
    greedy = decode_one(model, PROMPT, 8).tokens
    assert decode_one(MockStepModel(VOCAB), PROMPT, 8, SamplingParams(1.0, top_p=top_p), seed=3).tokens == greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=2.5), "top_k must be"),
    (dict(top_p=0), "top_p must be in"),
])
def test_invalid_sampling_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"temperature": 1.0, **kwargs})


def _splitmix(z: int) -> int:
    mask = (1 << 64) - 1
    z &= mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_position_keys_are_a_hash_of_seed_position_and_token():
    """The keys follow splitmix64 bit for bit (int64 products wrap like uint64 ones), depend on the seed, the
    position and the token only, and are Exp(1)."""
    golden, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    seeds, positions = torch.tensor([3, 2**63 - 1]), torch.tensor([[5, 6], [5, 7]])
    keys = position_keys(seeds, positions, 4)
    for b, seed in enumerate(seeds.tolist()):
        for r, position in enumerate(positions[b].tolist()):
            row = _splitmix((_splitmix(seed + golden) + position * golden) & mask)
            for token in range(4):
                bits = _splitmix((row + (token + 1) * golden) & mask) >> 11
                assert keys[b, r, token].item() == pytest.approx(-torch.log(torch.tensor((bits + 0.5) * 2.0**-53,
                                                                                          dtype=torch.float64)).item())
    assert torch.equal(keys[:, :1], position_keys(seeds, positions[:, :1], 4))  # nothing but (seed, position, token)
    many = position_keys(torch.tensor([11]), torch.arange(200)[None], 500).flatten()
    assert abs(many.mean().item() - 1) < 0.01 and abs(many.var().item() - 1) < 0.02 and (many > 0).all()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(0.9, top_p=0.8)],
                         ids=["T1", "T0.7-topk3", "T0.9-topp0.8"])
def test_a_seeded_race_draws_from_the_target(params):
    """Over seeds, the winner at one position follows the target (chi-square): a single draft token is therefore
    accepted with its target probability, Algorithm 4's rate."""
    torch.manual_seed(0)
    logits = torch.randn(VOCAB)
    target = target_probs(logits[None], params)[0]
    n = 4000
    winners = sample_positions(logits.expand(n, 1, VOCAB), params, torch.arange(n), torch.full((n, 1), 9))
    counts: dict = {}
    for token in winners.flatten().tolist():
        counts[(token,)] = counts.get((token,), 0) + 1
    expected = {(t,): target[t].item() for t in range(VOCAB)}
    assert chi_square_p(counts, expected, n) > P_FLOOR, (counts, expected)
    assert all(target[t] > 0 for (t,) in counts)  # never a token the target excludes


SEEDED = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.9)]
SEEDED_IDS = ["T1", "T0.7", "T1-topk3", "T0.7-topp0.9"]


@pytest.mark.parametrize("params", SEEDED, ids=SEEDED_IDS)
@pytest.mark.parametrize("cfg", [LookaheadConfig(3, 3, 3), LookaheadConfig(2, 4, 6, form="chains"), LookaheadConfig()],
                         ids=["W3-N3-G3-tree", "W2-N4-G6-chains", "default"])
def test_seeded_lookahead_sampling_gives_seeded_plain_sampling(params, cfg):
    """Token for token, whatever the step sizes (exact-size or static) and the drafts, on one prompt and in a
    batch: each token is a function of the seed, its position and the target there."""
    fn = lambda ctx: context_logits(ctx, VOCAB)  # noqa: E731
    accepted = 0
    for seed in range(8):
        plain = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, seed=seed).tokens
        for static in (False, True):
            result = decode_one(MockStepModel(VOCAB, fn), PROMPT, 24, params, cfg, seed=seed, static_step=static)
            assert result.tokens == plain, (seed, static)
            accepted += len(result.tokens) > result.steps
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    rows = decode_rows(MockRowModel(VOCAB, fn), prompts, 24, params, cfg, seeds=[4, 5, 6])
    alone = [decode_one(MockStepModel(VOCAB, fn), p, 24, params, seed=s).tokens
             for p, s in zip(prompts, [4, 5, 6], strict=True)]
    assert [r.tokens for r in rows] == alone
    assert accepted > 0  # drafts were accepted: the walk was exercised


class _DeviceBlindModel(MockStepModel):
    """A mock whose step logits cannot be read (meta tensors): the loop must take everything it needs from the
    step's one fetched output (argmax, top-k, sampling's reads), as with a model on a GPU."""

    def step(self, tokens, pattern, rows, topk=0, sample=None):
        output = super().step(tokens, pattern, rows, topk, sample)
        output.logits = output.logits.to("meta")
        return output


@pytest.mark.parametrize("form", ["chains", "tree"])
def test_the_loop_reads_nothing_of_the_device_but_the_fetched_outputs(form):
    params = SamplingParams(0.8, top_p=0.9)
    cfg = LookaheadConfig(3, 3, 3, form=form)
    for lookahead in (None, cfg):
        args = dict(prompt=PROMPT, max_new_tokens=12, sampling=params, lookahead=lookahead, seed=11)
        assert decode_one(_DeviceBlindModel(VOCAB), **args).tokens == decode_one(MockStepModel(VOCAB), **args).tokens


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("flat_row", [False, True], ids=["peaked", "with-a-flat-row"])
def test_top_p_from_a_cpu_head_equals_the_full_sort(monkeypatch, top_p, flat_row):
    """A CPU sorts only the top CPU_HEAD tokens when their mass reaches top_p in every row: the same distribution
    as sorting the whole vocabulary. A flat row, whose head falls short, makes it sort everything."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5000) * 4
    if flat_row:
        logits[2] *= 0.02
    params = SamplingParams(1.0, top_p=top_p)
    probs = torch.softmax(logits, dim=-1)
    assert sampling._descending_head(probs, top_p)[0].shape[-1] == (5000 if flat_row else sampling.CPU_HEAD)
    head = target_probs(logits, params)
    monkeypatch.setattr(sampling, "CPU_HEAD", 10**9)
    assert torch.equal(head, target_probs(logits, params))
