"""The minimal LLaMA against transformers' LlamaForCausalLM, its KV cache, loading errors, bad input."""

import json
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from lookahead import LookaheadConfig
from lookahead.models import CheckpointError, ConfigError, Llama, LlamaConfig
from lookahead.models.runner import CachedRunner

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "headdim": dict(head_dim=32),
    "linear-rope": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    "llama3-rope": dict(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}),
}


def hf_logits(folder, ids):
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits, model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny_checkpoint, variant):
    folder = tiny_checkpoint(variant, **VARIANTS[variant])
    ids = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(1))
    expected, _ = hf_logits(folder, ids)
    assert (Llama.from_pretrained(folder)(ids) - expected).abs().max().item() < 1e-4


def rewrite_config(folder, tmp_path, edit):
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    raw = json.loads((target / "config.json").read_text())
    edit(raw)
    (target / "config.json").write_text(json.dumps(raw))
    return target


def test_old_rope_spelling_reads_like_new(tiny_checkpoint, tmp_path):
    """rope_theta + rope_scaling (older configs) gives the same model as rope_parameters."""
    folder = tiny_checkpoint("llama3-rope", **VARIANTS["llama3-rope"])

    def to_old(raw):
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params

    old = rewrite_config(folder, tmp_path, to_old)
    assert "rope_scaling" in json.loads((old / "config.json").read_text())
    ids = torch.randint(0, 101, (1, 120), generator=torch.Generator().manual_seed(2))
    expected, _ = hf_logits(folder, ids)
    assert LlamaConfig.from_file(old).rope == LlamaConfig.from_file(folder).rope
    assert (Llama.from_pretrained(old)(ids) - expected).abs().max().item() < 1e-4


BOTH_ROPE_SPELLINGS = {
    "scaling-no-theta": ({"rope_type": "default", "rope_theta": 5000.0}, {"rope_type": "linear", "factor": 2.0}, None),
    "scaling-own-theta": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
                          {"type": "linear", "factor": 2.0, "rope_theta": 3000.0}, None),
    "scaling-top-theta": ({"rope_type": "default", "rope_theta": 5000.0}, {"type": "llama3", **LLAMA3_ROPE}, 7000.0),
    "empty-scaling": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}, {}, None),
}


@pytest.mark.parametrize("case", list(BOTH_ROPE_SPELLINGS))
def test_rope_scaling_beside_rope_parameters_reads_like_transformers(tiny_checkpoint, tmp_path, case):
    """Both spellings in one config.json: transformers takes a non-empty rope_scaling whole (theta from it, else
    the top-level rope_theta, else 10000); it used to be ignored here."""
    parameters, scaling, theta = BOTH_ROPE_SPELLINGS[case]

    def both(raw):
        raw.update(rope_parameters=parameters, rope_scaling=scaling)
        if theta is not None:
            raw["rope_theta"] = theta

    folder = rewrite_config(tiny_checkpoint("gqa"), tmp_path, both)
    ids = torch.randint(0, 101, (1, 120), generator=torch.Generator().manual_seed(12))
    expected, _ = hf_logits(folder, ids)
    assert (Llama.from_pretrained(folder)(ids) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_unsupported_rope_scaling_beside_rope_parameters_is_refused(tiny_checkpoint, tmp_path, rope_type):
    folder = rewrite_config(tiny_checkpoint("gqa"), tmp_path, lambda raw: raw.update(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"type": rope_type, "factor": 2.0}))
    with pytest.raises(ConfigError, match=rf"rope type '{rope_type}' \(rope_scaling\) is not supported"):
        Llama.from_pretrained(folder)


def test_sharded_checkpoint(tiny_checkpoint):
    folder = tiny_checkpoint("sharded", max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(3))
    expected, _ = hf_logits(folder, ids)
    assert (Llama.from_pretrained(folder)(ids) - expected).abs().max().item() < 1e-4


def test_cached_decoding_equals_full_forward(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(4))
    full = model(ids)[0]
    runner = CachedRunner(model, num_blocks=3).sequence(48)
    prefill = runner.prefill(ids[0, :25].tolist())
    assert (prefill - full[24]).abs().max().item() < 1e-4
    from lookahead.loop import PLAIN_STEP

    for t in range(25, 40):
        logits = runner.step([int(ids[0, t])], PLAIN_STEP, [0]).logits
        runner.commit([0])
        assert (logits[0] - full[t]).abs().max().item() < 1e-4


def test_chunked_prefill_equals_full_forward(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(6))
    runner = CachedRunner(model, num_blocks=2).sequence(32)
    runner.prefill(ids[0, :17].tolist())
    assert (runner.prefill(ids[0, 17:].tolist()) - model(ids)[0, -1]).abs().max().item() < 1e-4


def test_greedy_generate_equals_transformers(tiny_checkpoint):
    folder = tiny_checkpoint("gqa")
    model = Llama.from_pretrained(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for seed in range(3):
        prompt = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(seed))
        expected = hf.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        result = model.generate(prompt[0], max_new_tokens=30, eos_token_id=[])
        assert result.tokens == expected[0, 12:].tolist()
        assert result.steps == len(result.tokens) == 30 and result.compression == 1.0


def test_eos_stops_generation(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    full = model.generate([5, 6, 7], max_new_tokens=20, eos_token_id=[])
    eos = full.tokens[6]
    stopped = model.generate([5, 6, 7], max_new_tokens=20, eos_token_id=eos)
    assert stopped.tokens == full.tokens[: full.tokens.index(eos) + 1]


def test_default_eos_comes_from_checkpoint(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert model.config.eos_token_id == (2,)  # transformers' LlamaConfig default, via generation_config.json


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_ids=[]), ValueError, "prompt_ids is empty"),
    (dict(prompt_ids=[1, 500]), ValueError, "outside the vocabulary"),
    (dict(prompt_ids=[1, -1]), ValueError, "outside the vocabulary"),
    (dict(prompt_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError, "1-D"),
    (dict(prompt_ids="hello"), TypeError, "list of ints"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens must be a positive int"),
    (dict(max_new_tokens=600), ValueError, "exceeds the model's max_position_embeddings"),
    (dict(temperature=-0.5), ValueError, "temperature must be"),
    (dict(top_p=0.0), ValueError, "top_p must be in"),
    (dict(top_p=1.5), ValueError, "top_p must be in"),
    (dict(top_k=-1), ValueError, "top_k must be"),
    (dict(lookahead=(5, 4, 5)), TypeError, "LookaheadConfig"),
    (dict(eos_token_id="x"), TypeError, "eos_token_id"),
    (dict(eos_token_id="12"), TypeError, "eos_token_id must be an int or a list of ints, got '12'"),
    (dict(eos_token_id=[True]), TypeError, r"eos_token_id must be an int or a list of ints, got \[True\]"),
    (dict(eos_token_id=True), TypeError, "eos_token_id must be an int or a list of ints"),
    (dict(eos_token_id=[2, -1]), ValueError, "eos_token_id must hold token ids >= 0"),
    (dict(prompt_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError, r"1-D or \[1, T\] tensor"),
    (dict(prompt_ids=torch.ones(1, 3)), TypeError, "must hold integers"),
    (dict(prompt_ids=[[1, 2], 3]), TypeError, "prompt_ids mixes token ids and prompts"),
    (dict(prompt_ids=[1, True]), TypeError, "list of ints"),
    (dict(prompt_ids={"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}), ValueError, "not all ones"),
    (dict(prompt_ids={"ids": [1, 2]}), TypeError, "without 'input_ids'"),
    (dict(seed=2**64, temperature=1.0), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(seed=-1, temperature=1.0), ValueError, "seed must be an int in"),
])
def test_generate_rejects_bad_input(tiny_checkpoint, kwargs, error, message):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        model.generate(**args)


@pytest.mark.parametrize("ids, error, message", [
    (torch.tensor([[1, 2, 101]]), ValueError, r"token id 101, outside the vocabulary \[0, 101\)"),
    (torch.tensor([[1, -1, 2]]), ValueError, r"token id -1, outside the vocabulary \[0, 101\)"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "input_ids must hold integer token ids, got torch.float32"),
    (torch.tensor([[True]]), TypeError, "input_ids must hold integer token ids, got torch.bool"),
    ([[1, 2]], TypeError, "input_ids must be a torch.Tensor"),
    (torch.tensor([1, 2]), ValueError, r"input_ids must be \[B, T\], got shape \(2,\)"),
    (torch.tensor([[1, 2]], device="meta"), ValueError, "input_ids are on meta, the model on cpu"),
], ids=["over-vocab", "negative", "float", "bool", "list", "1-D", "other-device"])
def test_forward_refuses_bad_ids(tiny_checkpoint, ids, error, message):
    """`model(ids)` is a public entry: one clear error instead of an index error deep in torch."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    with pytest.raises(error, match=message):
        model(ids)


def test_generation_steps_skip_the_ids_check(tiny_checkpoint, monkeypatch):
    """The check reads the ids on the host; the runner's per-step forward (which passes its attention) must not."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert model(torch.tensor([[0, 100]])).shape == (1, 2, 101)  # the vocabulary's ends are fine

    def sync(self, ids):
        raise AssertionError("the ids check ran inside generate")

    monkeypatch.setattr(Llama, "_check_input_ids", sync)
    result = model.generate([1, 2, 3], max_new_tokens=6, lookahead=LookaheadConfig(), eos_token_id=[])
    assert len(result.tokens) == 6


def test_generate_accepts_what_transformers_hands_over(tiny_checkpoint):
    """A list, a 1-D tensor, apply_chat_template's [1, T] tensor, a BatchEncoding: the same prompt. A list holding
    the list is a batch of one (a list of results)."""
    from transformers import BatchEncoding

    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    ids = [5, 17, 3, 99, 42]
    expected = model.generate(ids, max_new_tokens=6, eos_token_id=[]).tokens
    forms = [torch.tensor(ids), torch.tensor([ids]), {"input_ids": ids},
             BatchEncoding({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, 5, dtype=torch.long)})]
    for form in forms:
        assert model.generate(form, max_new_tokens=6, eos_token_id=[]).tokens == expected, type(form)
    assert [r.tokens for r in model.generate([ids], max_new_tokens=6, eos_token_id=[])] == [expected]


def test_tiny_temperature_samples_like_greedy(tiny_checkpoint):
    """1e-40 used to overflow to inf logits and NaN probabilities; it is the greedy limit."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    greedy = model.generate([1, 2, 3], max_new_tokens=8, eos_token_id=[]).tokens
    for temperature in (1e-40, 5e-324):
        assert model.generate([1, 2, 3], max_new_tokens=8, eos_token_id=[], temperature=temperature, seed=0,
                              lookahead=LookaheadConfig()).tokens == greedy


def test_unsupported_dtype_and_backend(tiny_checkpoint):
    folder = tiny_checkpoint("gqa")
    with pytest.raises(ValueError, match="unsupported dtype"):
        Llama.from_pretrained(folder, dtype=torch.int8)
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        Llama.from_pretrained(folder, attn_backend="flash")


def test_half_precision_loads_and_runs(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.rope_inv_freq.dtype == torch.float32
    assert model.generate([1, 2, 3], max_new_tokens=3).steps == 3


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(model_type="gemma"), r"model_type 'gemma' is not supported natively.*lookahead\.hf"),
    (lambda raw: raw.update(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda raw: raw.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
])
def test_config_errors_name_the_field(tiny_checkpoint, tmp_path, edit, message):
    folder = rewrite_config(tiny_checkpoint("gqa"), tmp_path, edit)
    with pytest.raises(ConfigError, match=message):
        Llama.from_pretrained(folder)


def test_checkpoint_errors_name_the_tensor_or_file(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_checkpoint("gqa")
    weights = load_file(folder / "model.safetensors")

    def variant(name, tensors):
        target = tmp_path / name
        shutil.copytree(folder, target)
        save_file(tensors, target / "model.safetensors")
        return target

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        Llama.from_pretrained(variant("missing", missing))
    extra = {**weights, "model.layers.9.self_attn.q_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9"):
        Llama.from_pretrained(variant("extra", extra))
    bad_shape = {**weights, "model.norm.weight": torch.zeros(63)}
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(63,\)"):
        Llama.from_pretrained(variant("shape", bad_shape))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(folder, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        Llama.from_pretrained(corrupt)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Llama.from_pretrained(empty)
    (empty / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        Llama.from_pretrained(empty)


def test_plain_forward_is_causal_without_cache(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(5))
    assert torch.allclose(model(ids)[0, :10], model(ids[:, :10])[0], atol=1e-5)


LONG = dict(max_position_embeddings=4096)


def test_positions_past_2048_match_transformers(tiny_checkpoint):
    """RoPE at large positions: an fp16/bf16 table or fp16 angles would drift here, not at position 90."""
    folder = tiny_checkpoint("long", **LONG)
    ids = torch.randint(0, 101, (1, 2300), generator=torch.Generator().manual_seed(8))
    expected, hf = hf_logits(folder, ids)
    model = Llama.from_pretrained(folder)
    assert (model(ids) - expected).abs().max().item() < 1e-4
    prompt = ids[:, :2040]  # decoding crosses position 2048 through the KV cache and lookahead steps
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # the mask: token 0 in the prompt is not padding
    for lookahead in (None, LookaheadConfig(3, 4, 3)):
        assert model.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=lookahead).tokens == \
            greedy[0, 2040:].tolist()


@pytest.mark.parametrize("dtype, cast", [("bfloat16", lambda m: m.to(torch.bfloat16)), ("float16", lambda m: m.half())],
                         ids=["to-bf16", "half"])
def test_casting_the_model_keeps_rope_in_fp32(tiny_checkpoint, dtype, cast):
    """model.to(bfloat16) / .half() must give the same model as loading in that dtype (RoPE stays fp32)."""
    folder = tiny_checkpoint("long", **LONG)
    ids = torch.randint(0, 101, (1, 2200), generator=torch.Generator().manual_seed(9))
    loaded = Llama.from_pretrained(folder, dtype=dtype)
    cast_model = cast(Llama.from_pretrained(folder))
    assert cast_model.dtype == loaded.dtype
    assert torch.equal(cast_model(ids[:, 2100:]), loaded(ids[:, 2100:]))
    positions = ids[:, :2200]
    assert torch.equal(cast_model(positions)[0, -50:], loaded(positions)[0, -50:])
