"""lookahead.hf on transformers' own LlamaForCausalLM: exact against its greedy generate, the same through
custom_generate, the model left as it was, sampling keeps the distribution, and what it refuses."""

import importlib.metadata
import re
import subprocess
import sys

import pytest
import torch
import transformers
from test_model import VARIANTS
from test_sampling import DEPTH, P_FLOOR, PROMPT, VOCAB, distribution_p_values, exact_joint
from transformers import LlamaForCausalLM

import lookahead.hf as lh
import lookahead.hf.api as hf_api
import lookahead.hf.step_model as hf_step_model
import lookahead.hf.tuning as hf_tuning
import lookahead.loop as loop
import lookahead.loop.core as core
from helpers import RandomCost, fixed, needs_interpreter
from lookahead import LookaheadConfig, SamplingParams
from lookahead.drafts import ROOT
from lookahead.loop.verify import Verdict
from lookahead.tuning import CostModel, Curve, knots_up_to, store

CONFIGS = [(1, 2, 0), (3, 4, 3), (5, 4, 5), (15, 5, 15)]
IDS = [f"W{w}-N{n}-G{g}" for w, n, g in CONFIGS]
REPETITIVE = [5, 17, 22, 5, 17, 9, 31, 5, 17, 22, 40, 5, 17, 22]
NO_EOS = dict(eos_token_id=None, pad_token_id=0)  # transformers: never stop early


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    """Factory: a tiny random LlamaForCausalLM of a test_model.VARIANTS variant, loaded by transformers."""
    loaded = {}

    def load(variant="gqa", **overrides):
        key = (variant, repr(sorted(overrides.items())))
        if key not in loaded:
            folder = tiny_checkpoint(variant, **{**VARIANTS.get(variant, {}), **overrides})
            loaded[key] = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return loaded[key]

    return load


def prompts(vocab=101):
    random = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    return [random, REPETITIVE]


def hf_greedy(model, prompt, new, **kwargs):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", ["mha", "gqa", "tied", "llama3-rope"])
def test_greedy_equals_transformers_greedy(hf_model, variant):
    model = hf_model(variant)
    tokens = steps = 0
    for prompt in prompts():
        expected = hf_greedy(model, prompt, 48, **NO_EOS)
        for W, N, G in CONFIGS:
            result = lh.generate(model, prompt, max_new_tokens=48, lookahead=fixed(W, N, G), eos_token_id=[])
            assert result.tokens == expected, f"W{W}-N{N}-G{G} prompt {prompt}"
            if G > 0:
                tokens, steps = tokens + len(result.tokens), steps + result.steps
    assert tokens / steps > 1.5  # S > 1: multi-token steps happen


@pytest.mark.parametrize("W, N, G", CONFIGS, ids=IDS)
def test_static_steps_give_the_same_tokens_and_steps(hf_model, W, N, G):
    model = hf_model("gqa")
    expected = hf_greedy(model, REPETITIVE, 40, **NO_EOS)
    exact = lh.generate(model, REPETITIVE, 40, fixed(W, N, G), eos_token_id=[], static_step=False)
    static = lh.generate(model, REPETITIVE, 40, fixed(W, N, G), eos_token_id=[], static_step=True)
    assert exact.tokens == static.tokens == expected
    assert exact.step_tokens == static.step_tokens


@pytest.mark.parametrize("static", [False, True])
def test_self_tuned_steps_of_any_size_equal_transformers_greedy(hf_model, static):
    """Steps sized by a cost model that answers at random (every size meets the plug-in) give transformers' tokens."""
    model = hf_model("gqa")
    lh.model_state(model).cost_model = RandomCost(3)
    try:
        for prompt in prompts()[:3]:
            result = lh.generate(model, prompt, 40, LookaheadConfig(), eos_token_id=[], static_step=static)
            assert result.tokens == hf_greedy(model, prompt, 40, **NO_EOS)
            assert len(set(result.step_sizes)) > 1
        ids = model.generate(torch.tensor([REPETITIVE]), custom_generate=lh.custom_generate, max_new_tokens=40,
                             do_sample=False, static_step=static, **NO_EOS)
        assert ids[0, len(REPETITIVE):].tolist() == hf_greedy(model, REPETITIVE, 40, **NO_EOS)
    finally:
        lh.model_state(model).cost_model = None


def test_the_plug_in_measures_its_model_once_then_reads_the_cache(hf_model, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    measured = []
    real = hf_tuning.measure
    monkeypatch.setattr(hf_tuning, "measure", lambda *a: measured.append(a[0].length) or real(*a))
    model = hf_model("tied")
    lh.model_state(model).cost_model = None  # as a model no generation has used (earlier tests used this one)
    expected = hf_greedy(model, REPETITIVE, 24, **NO_EOS)
    result = lh.generate(model, REPETITIVE, 24, LookaheadConfig(), eos_token_id=[])
    assert result.tokens == expected and measured == [0]  # measured before the prefill, on the empty cache
    cost = lh.model_state(model).cost_model
    assert cost.key["backend"] == "hf:torch"
    assert cost.curves["greedy"].knots == knots_up_to(LookaheadConfig().step_tokens)
    (path,) = tmp_path.iterdir()
    assert CostModel.load(path, cost.key) is not None
    # the same model again: its kept cost model; the cache file serves a model that has none (another process)
    lh.generate(model, REPETITIVE, 8, LookaheadConfig(), eos_token_id=[])
    lh.model_state(model).cost_model = None
    lh.generate(model, REPETITIVE, 8, LookaheadConfig(), eos_token_id=[])
    assert measured == [0]
    # sampling is another kind of step; plain and fixed steps measure nothing
    lh.generate(model, REPETITIVE, 8, LookaheadConfig(), temperature=1.0, seed=1)
    lh.generate(model, REPETITIVE, 8, None)
    lh.generate(model, REPETITIVE, 8, fixed())
    assert measured == [0, 0] and set(lh.model_state(model).cost_model.curves) == {"greedy", "sampling"}
    # a cost model set by the user is used as it is, never written
    mine = CostModel({"greedy": Curve([1, 64], [0.01, 0.02], [0.0, 0.0])})
    lh.model_state(model).cost_model = mine
    lh.generate(model, REPETITIVE, 8, LookaheadConfig(), eos_token_id=[])
    assert lh.model_state(model).cost_model is mine and measured == [0, 0] and len(list(tmp_path.iterdir())) == 1
    lh.model_state(model).cost_model = None


def test_default_eos_and_input_forms(hf_model):
    """eos from the model's generation_config; a [1, T] tensor, a 1-D tensor, a list and a BatchEncoding."""
    model = hf_model("gqa")
    prompt = torch.randint(0, 101, (8,), generator=torch.Generator().manual_seed(1)).tolist()  # emits eos 2
    expected = hf_greedy(model, prompt, 48)
    assert expected[-1] == 2 and len(expected) < 48
    encoding = transformers.BatchEncoding({"input_ids": torch.tensor([prompt]),
                                           "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)})
    for form in (torch.tensor([prompt]), torch.tensor(prompt), prompt, encoding):
        assert lh.generate(model, form, max_new_tokens=48, lookahead=LookaheadConfig(5, 4, 5)).tokens == expected
    out = model.generate(torch.tensor([prompt]), custom_generate=lh.custom_generate, max_new_tokens=48)
    assert out[0, len(prompt):].tolist() == expected


@needs_interpreter
def test_triton_kernel_as_the_step_attention(hf_model):
    """attn_backend='triton' runs lookahead_attention on the model's CPU tensors, in Triton's interpreter (on a CUDA
    host, where the interpreter is off, it skips: the model here is on the CPU)."""
    model = hf_model("gqa")
    expected = hf_greedy(model, REPETITIVE, 16, **NO_EOS)
    plans = []
    original = lh.step_model.StepAttentionPlan

    def counted(*args, **kwargs):
        plans.append(args[0])
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lh.step_model, "StepAttentionPlan", counted)
        result = lh.generate(model, REPETITIVE, 16, fixed(5, 4, 5), eos_token_id=[], attn_backend="triton")
    assert result.tokens == expected and result.compression > 1
    # one launch plan per step, shared by the layers: no per-layer checks, host tensors or plans
    assert len(plans) == result.steps - 1 and model.config.num_hidden_layers > 1


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_custom_generate_returns_plain_greedy_sequences(hf_model, variant):
    model = hf_model(variant)
    for prompt in prompts():
        ids = torch.tensor([prompt])
        for kwargs in (NO_EOS, {}):
            expected = model.generate(ids, max_new_tokens=40, do_sample=False, **kwargs)
            out = model.generate(ids, custom_generate=lh.custom_generate, lookahead=LookaheadConfig(5, 4, 5),
                                 max_new_tokens=40, **kwargs)
            assert torch.equal(out, expected)
    ids = torch.tensor([REPETITIVE])
    expected = model.generate(ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, **NO_EOS)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=lh.custom_generate,
                         max_new_tokens=30, return_dict_in_generate=True, **NO_EOS)
    assert torch.equal(out.sequences, expected.sequences)
    # the cache is left as plain generate leaves it: every token but the last
    our_cache, their_cache = (getattr(o, hf_step_model.cache_keyword(model)) for o in (out, expected))  # 5.24 renamed
    assert our_cache.get_seq_length() == their_cache.get_seq_length() == ids.shape[1] + 29
    for ours, theirs in zip(our_cache.layers, their_cache.layers, strict=True):
        assert (ours.keys - theirs.keys).abs().max().item() < 1e-4


IMPORTS = """
import sys
import lookahead, lookahead.loop
print('transformers' in sys.modules)
import lookahead.hf
print('transformers' in sys.modules, any(m.startswith('lookahead.models') for m in sys.modules))
"""


def test_transformers_stays_optional_and_models_unused():
    """`import lookahead` (and the loop) never loads transformers; lookahead.hf loads it on first use only and
    never loads lookahead.models."""
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]


def snapshot(model):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    # the adapter's own names (`lookahead:<own>`, registered once per implementation) aside, no mask function is added
    masks = sorted(m for m in transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
                   if not m.startswith(f"{lh.ATTENTION_NAME}:"))
    return (model.config._attn_implementation, model.config.to_dict(), model.generation_config.to_dict(), hooks,
            masks, type(model), model.training)


def test_model_is_left_unchanged(hf_model, monkeypatch):
    model = hf_model("gqa")
    before, expected = snapshot(model), hf_greedy(model, REPETITIVE, 32, **NO_EOS)
    lh.generate(model, REPETITIVE, 32, LookaheadConfig(5, 4, 5), eos_token_id=[])
    lh.generate(model, REPETITIVE, 32, LookaheadConfig(3, 4, 3), temperature=0.8, top_k=20, seed=3)
    model.generate(torch.tensor([REPETITIVE]), custom_generate=lh.custom_generate, max_new_tokens=32)
    with monkeypatch.context() as patch:  # a step that fails half way restores the attention implementation
        patch.setattr(hf_step_model, "masked_attention", lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            lh.generate(model, REPETITIVE, 32, LookaheadConfig(5, 4, 5))
    assert snapshot(model) == before
    assert hf_greedy(model, REPETITIVE, 32, **NO_EOS) == expected
    with pytest.raises(RuntimeError, match="runs only inside lookahead.hf steps"):  # selected by hand: refused
        model.config._attn_implementation = lh.ATTENTION_NAME
        try:
            model(torch.tensor([REPETITIVE]))
        finally:
            model.config._attn_implementation = before[0]


def vocab6_model(hf_model):
    return hf_model("vocab6", vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=48)


def sample_counts(model, n, form="tree"):
    counts, multi = {}, 0
    for seed in range(n):
        # full-size steps: self-tuned ones follow the machine's measured costs, and under load they stay plain
        cfg = LookaheadConfig(3, 3, 3, form=form, budget="fixed")
        result = lh.generate(model, PROMPT, DEPTH, cfg, temperature=1.0, seed=seed, eos_token_id=[])
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        multi += any(len(s) > 1 for s in result.step_tokens)
    return counts, multi / n


def hf_logits(model):
    return lambda ctx: model(torch.tensor([ctx])).logits[0, -1].double()


@torch.no_grad()
def test_sampling_matches_exact_distribution(hf_model):
    """test_sampling's chi-square check, through transformers' model, DynamicCache and our commit."""
    model = vocab6_model(hf_model)
    joint = exact_joint(hf_logits(model), PROMPT, SamplingParams(1.0))
    n = 1000
    counts, multi = sample_counts(model, n)
    assert multi > 0.2, f"only {multi:.0%} of runs accepted a candidate token: verification barely exercised"
    checks = distribution_p_values(counts, joint, n)
    assert min(checks.values()) > P_FLOOR, checks


@torch.no_grad()
def test_a_wrong_acceptance_rule_fails_the_same_check(hf_model, monkeypatch):
    """Negative control: always accepting the first candidate (chains form) must be caught with the same model."""

    def accept_first_path(tree, chosen):
        node, tokens = ROOT, []
        while (child := next(iter(tree.children(node)), None)) is not None:
            node = child
            tokens.append(tree.tokens[child])
        return Verdict(tokens + [chosen[node + 1]], node)

    monkeypatch.setattr(core, "verify", accept_first_path)
    model = vocab6_model(hf_model)
    n = 400
    counts, _ = sample_counts(model, n, form="chains")
    checks = distribution_p_values(counts, exact_joint(hf_logits(model), PROMPT, SamplingParams(1.0)), n)
    assert checks["joint"] < P_FLOOR, checks


def test_custom_generate_samples_with_transformers_settings(hf_model, monkeypatch):
    """do_sample's temperature, top_k and top_p reach the loop; torch.manual_seed makes it reproducible."""
    model = hf_model("gqa")
    seen = []
    monkeypatch.setattr(hf_api, "decode",
                        lambda *args, **kwargs: seen.append(args[1].sampling) or loop.decode(*args, **kwargs))
    args = dict(custom_generate=lh.custom_generate, max_new_tokens=24, do_sample=True, temperature=0.7, top_k=5,
                top_p=0.9, **NO_EOS)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(model.generate(torch.tensor([REPETITIVE]), **args))
    assert torch.equal(runs[0], runs[1])
    assert seen == [SamplingParams(0.7, 5, 0.9)] * 2
    model.generate(torch.tensor([REPETITIVE]), custom_generate=lh.custom_generate, max_new_tokens=4, do_sample=True)
    assert seen[-1] == SamplingParams(1.0, 50, 1.0)  # transformers' own defaults when sampling


def other_model(kind, **config):
    base = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=1, n_head=2))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**base, **config))
    cfg = transformers.LlamaConfig(**base, **config)
    return transformers.LlamaModel(cfg) if kind == "llama-no-head" else transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("kind, config, message", [
    ("gpt2", {}, "architecture 'gpt2'"),
    ("llama-no-head", {}, "must be a transformers decoder-only causal LM .*got LlamaModel"),
    ("mistral", dict(sliding_window=64), "sliding-window attention"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "'dynamic'"),
], ids=["gpt2", "no-lm-head", "sliding-window", "dynamic-rope"])
def test_models_it_cannot_drive_are_refused(kind, config, message):
    with pytest.raises((TypeError, ValueError), match=message):
        lh.generate(other_model(kind, **config), [1, 2, 3], max_new_tokens=4)


FAMILIES = {  # model_type: (config class, model class, the config beyond a tiny LLaMA's)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=None, num_local_experts=2,
                                                            num_experts_per_tok=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=2, num_experts_per_tok=1,
                                                                moe_intermediate_size=16, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(eos_token_id=None)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(eos_token_id=None)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_architectures_equal_their_own_greedy(family):
    """Every architecture the adapter accepts beyond LLaMA (and Qwen2/3, tested above) decodes, with lookahead, what
    transformers' own greedy decoding gives."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(vocab_size=101, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 **extra)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # larger weights than the default init: outputs that depend on the context
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    assert model.config.model_type == family
    expected = hf_greedy(model, REPETITIVE, 20, **NO_EOS)
    result = lh.generate(model, REPETITIVE, 20, fixed(3, 4, 3), eos_token_id=[])
    assert result.tokens == expected and result.compression > 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=torch.tensor([[1, 2], [3, 4]])), r"batch size 1\), got shape \(2, 2\)"),
    (dict(input_ids=torch.tensor([1.0, 2.0])), "must hold integers"),
    (dict(input_ids=[]), "input_ids is empty"),
    (dict(input_ids=[[1, 2], [3, 4]]), r"input_ids must be a list of ints \(one prompt\)"),
    (dict(input_ids=[1, 500]), r"token id\(s\) \[500\] outside the vocabulary"),
    (dict(input_ids=transformers.BatchEncoding({"input_ids": [[0, 1, 2]], "attention_mask": [[0, 1, 1]]})),
     "padded prompt"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    (dict(lookahead=(3, 4, 3)), "lookahead must be None, 'auto' or a LookaheadConfig"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(attn_backend="cuda"), "attn_backend must be one of"),
    (dict(eos_token_id="2"), "eos_token_id must be"),
], ids=lambda x: None)
def test_bad_generate_arguments(hf_model, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        lh.generate(hf_model("gqa"), **{"input_ids": [1, 2, 3], "max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), "not beam_search"),
    (dict(repetition_penalty=1.3), "logits processor RepetitionPenaltyLogitsProcessor"),
    (dict(min_new_tokens=2), r"logits processor Min\w*LogitsProcessor"),
    (dict(logits_processor=transformers.LogitsProcessorList([transformers.NoBadWordsLogitsProcessor([[7]], 2)])),
     "logits processor NoBadWordsLogitsProcessor"),
    (dict(do_sample=True, min_p=0.1), "logits processor MinPLogitsWarper"),
    (dict(max_time=10.0), "stopping criterion MaxTimeCriteria"),
    (dict(do_sample=True, num_return_sequences=2), "one sequence at a time"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores=True"),
    (dict(cache_implementation="static"), "got a StaticCache"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1]])), "padded prompt"),
], ids=lambda x: None)
def test_custom_generate_refuses_what_it_cannot_honour(hf_model, kwargs, message):
    model = hf_model("gqa")
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[3, 1, 4, 1]]), custom_generate=lh.custom_generate, max_new_tokens=4, **kwargs)


class RecordingStreamer(transformers.generation.streamers.BaseStreamer):
    """What transformers' streamers receive: each put's token ids, and how many times end() was called."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def test_custom_generate_feeds_a_streamer(hf_model):
    """A streamer used to get the prompt (transformers puts it) and nothing more, never end(): a reader of a
    TextIteratorStreamer waited for ever. Now: the prompt, the new tokens step by step, end() (after a refusal too)."""
    model = hf_model("gqa")
    ids = torch.tensor([REPETITIVE])
    plain, ours, refused = RecordingStreamer(), RecordingStreamer(), RecordingStreamer()
    expected = model.generate(ids, max_new_tokens=24, do_sample=False, streamer=plain, **NO_EOS)
    out = model.generate(ids, custom_generate=lh.custom_generate, lookahead=LookaheadConfig(5, 4, 5), max_new_tokens=24,
                         streamer=ours, **NO_EOS)
    assert torch.equal(out, expected)
    assert ours.puts[0] == plain.puts[0] == [REPETITIVE]
    new = expected[0, len(REPETITIVE):].tolist()
    assert [t for put in ours.puts[1:] for t in put] == [t for put in plain.puts[1:] for t in put] == new
    assert any(len(put) > 1 for put in ours.puts[1:])  # a multi-token step arrives in one put
    assert ours.ended == plain.ended == 1
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(ids, custom_generate=lh.custom_generate, max_new_tokens=4, repetition_penalty=1.3,
                       streamer=refused)
    assert refused.ended == 1


def test_decoding_past_max_position_embeddings_is_refused(hf_model):
    """Both entries used to decode past the positions the model was built for without a word."""
    model = hf_model("gqa", max_position_embeddings=16)
    assert len(lh.generate(model, [1, 2, 3], max_new_tokens=13, eos_token_id=[]).tokens) == 13  # 16 positions: fine
    with pytest.raises(ValueError, match=re.escape("prompt (3 tokens) + max_new_tokens (14) = 17 exceeds the model's "
                                                   "max_position_embeddings (16)")):
        lh.generate(model, [1, 2, 3], max_new_tokens=14)
    out = model.generate(torch.tensor([[1, 2, 3]]), custom_generate=lh.custom_generate, max_new_tokens=13, **NO_EOS)
    assert out.shape == (1, 16)
    with pytest.raises(ValueError, match=re.escape("prompt (3 tokens) + max_new_tokens (14) = 17 exceeds the model's "
                                                   "max_position_embeddings (16); shorten the prompt or lower "
                                                   "max_new_tokens")):
        model.generate(torch.tensor([[1, 2, 3]]), custom_generate=lh.custom_generate, max_new_tokens=14)


def test_a_filled_cache_is_refused(hf_model):
    model = hf_model("gqa")
    cache = transformers.DynamicCache(config=model.config)
    model(torch.tensor([[1, 2, 3]]), **{hf_step_model.cache_keyword(model): cache})
    with pytest.raises(ValueError, match="already holds 3 positions"):
        lh.HFStepModel(model, cache)


@pytest.mark.parametrize("module, missing, named", [
    (transformers.modeling_utils, "AttentionInterface", "AttentionInterface"),
    (transformers.cache_utils, "DynamicLayer", "cache_utils.DynamicLayer"),
    (transformers.GenerationMixin, "_extract_generation_mode_kwargs", "generate(custom_generate=<callable>)"),
], ids=["AttentionInterface", "DynamicLayer", "custom_generate"])
def test_transformers_without_the_hooks_gets_a_clear_error(hf_model, monkeypatch, module, missing, named):
    model = hf_model("gqa")
    monkeypatch.delattr(module, missing)
    message = (f"needs transformers >= {lh.MIN_TRANSFORMERS}; found transformers {transformers.__version__}, "
               f"which lacks {named}")
    with pytest.raises(ImportError, match=re.escape(message)):
        lh.generate(model, [1, 2, 3], max_new_tokens=4)
    if _plain_generate_runs(model):  # else transformers' own generate breaks first, before it calls custom_generate
        with pytest.raises(ImportError, match=re.escape(message)):
            model.generate(torch.tensor([[1, 2, 3]]), custom_generate=lh.custom_generate, max_new_tokens=4)


def test_the_install_requires_what_the_adapter_needs():
    """setup.py cannot import the package, so it states MIN_TRANSFORMERS again: the two must agree."""
    assert f"transformers>={lh.MIN_TRANSFORMERS}" in importlib.metadata.requires("lookahead")


def _plain_generate_runs(model) -> bool:
    """Whether transformers' own generate still runs with a hook removed (then it reaches custom_generate): without
    GenerationMixin's it never does; without DynamicLayer, 5.24's does where older ones build no cache."""
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False, **NO_EOS)
    except (AttributeError, NameError):
        return False
    return True


@pytest.mark.slow
def test_default_model_greedy_equals_transformers(default_model_dir):
    from transformers import AutoTokenizer

    model = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    messages = [{"role": "user", "content": "Write a python function that reverses a string."}]
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    ids = encoding["input_ids"]
    expected = model.generate(**encoding, max_new_tokens=48, do_sample=False, **NO_EOS)
    result = lh.generate(model, encoding, max_new_tokens=48, lookahead=fixed(5, 4, 5), eos_token_id=[])
    assert result.tokens == expected[0, ids.shape[1]:].tolist()
    assert result.compression > 1
    out = model.generate(ids, custom_generate=lh.custom_generate, max_new_tokens=48, do_sample=False, **NO_EOS)
    assert torch.equal(out, expected)
