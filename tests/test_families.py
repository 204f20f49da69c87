"""The LLaMA-shaped families run natively (Qwen2/Qwen2.5, Qwen3 dense, Mistral), each held to transformers'
logits and to plain greedy under lookahead; what they cannot run is refused with a message that says why."""

import json
import shutil
import warnings

import pytest
import torch
import transformers

from helpers import flat_cost, needs_interpreter
from lookahead import LookaheadConfig
from lookahead.models import ConfigError, Llama, LlamaConfig

FAMILY_CASES = {
    "qwen2": dict(family="qwen2"),  # q/k/v biases, no o_proj bias
    "qwen2-tied": dict(family="qwen2", tie_word_embeddings=True),  # as Qwen2.5-0.5B/1.5B ship
    "qwen3": dict(family="qwen3", head_dim=32),  # per-head q/k RMSNorm; head_dim apart from hidden / heads
    "qwen3-bias": dict(family="qwen3", head_dim=32, attention_bias=True),  # then o_proj has a bias too
    "mistral": dict(family="mistral", sliding_window=None),
    "mistral-wide-window": dict(family="mistral", sliding_window=512),  # a window of the whole context is none
}
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
IDS = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(21))


def family_checkpoint(tiny_checkpoint, case):
    return tiny_checkpoint(case, **FAMILY_CASES[case])


def hf_model(folder, family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, CLASSES[family]).from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_logits_match_transformers(tiny_checkpoint, case):
    folder = family_checkpoint(tiny_checkpoint, case)
    with torch.no_grad():
        expected = hf_model(folder, FAMILY_CASES[case]["family"])(IDS).logits
    model = Llama.from_pretrained(folder)
    assert model.config.model_type == FAMILY_CASES[case]["family"]
    assert (model(IDS) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["qwen2", "qwen3-bias", "mistral"])
def test_lookahead_equals_plain_greedy_equals_transformers(tiny_checkpoint, case):
    """fp32, torch backend: lookahead's tokens are plain greedy's, and those are transformers' greedy tokens."""
    folder = family_checkpoint(tiny_checkpoint, case)
    model = Llama.from_pretrained(folder, dtype=torch.float32, attn_backend="torch")
    model.cost_model = flat_cost()  # multi-token steps whatever the machine's load (S > 1 is checked)
    hf = hf_model(folder, FAMILY_CASES[case]["family"])
    for seed in range(2):
        prompt = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(seed))
        plain = model.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=None)
        assert len(set(plain.tokens)) > 3  # a model that repeats one token would make the comparison empty
        for cfg in (LookaheadConfig(), LookaheadConfig(3, 4, 3, form="chains")):
            result = model.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=cfg)
            assert result.tokens == plain.tokens and result.compression > 1.0
        greedy = hf.generate(prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=24,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert plain.tokens == greedy[0, 12:].tolist()


@needs_interpreter
def test_triton_backend_on_qwen3(tiny_checkpoint):
    """The kernel path sees q and k after the q/k norm and RoPE as the torch path does."""
    folder = family_checkpoint(tiny_checkpoint, "qwen3-bias")
    prompt = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(3))
    plain = Llama.from_pretrained(folder, attn_backend="torch").generate(prompt, max_new_tokens=12, eos_token_id=[])
    assert len(set(plain.tokens)) > 3
    kernel = Llama.from_pretrained(folder, attn_backend="triton")
    kernel.cost_model = flat_cost()
    result = kernel.generate(prompt, max_new_tokens=12, eos_token_id=[], lookahead=LookaheadConfig(2, 3, 2),
                             static_step=True)
    assert result.tokens == plain.tokens and result.compression > 1.0


def raw_config(family, **fields):
    base = dict(model_type=family, vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    return {**base, **fields}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_defaults_of_absent_fields_are_transformers(family):
    """A config.json without head_dim / max_position_embeddings: each family's own defaults (Qwen3's head_dim is
    128 whatever hidden_size / heads is)."""
    raw = raw_config(family, sliding_window=None)
    hf = transformers.AutoConfig.for_model(**raw)
    ours = LlamaConfig.from_dict(raw)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # as their attention reads it
    assert (ours.head_dim, ours.max_position_embeddings) == (head_dim, hf.max_position_embeddings)


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="mistral", sliding_window=256), "sliding_window 256 is smaller than max_position_embeddings 512"),
    (dict(model_type="mistral", sliding_window=None, max_position_embeddings=8192, _drop="sliding_window"),
     r"sliding_window 4096 \(transformers' default for 'mistral'\) is smaller"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=1, layer_types=None),
     "1 layer.* attend to a sliding window"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=128,
          layer_types=["full_attention", "sliding_attention"]), "sliding_window 128 is smaller"),
    (dict(model_type="qwen2", layer_types=["full_attention"]), "'layer_types' must list 2 of"),
    (dict(model_type="gemma2"), r"model_type 'gemma2' is not supported natively .*lookahead\.hf\.generate"),
    (dict(model_type="qwen3_moe"), r"model_type 'qwen3_moe' .*lookahead\.hf"),
], ids=["mistral-window", "mistral-default-window", "qwen2-window-layers", "qwen3-layer-types", "layer-types-short",
        "gemma2", "qwen3-moe"])
def test_what_cannot_run_is_refused(tiny_checkpoint, tmp_path, fields, message):
    family = fields["model_type"] if fields["model_type"] in CLASSES else "qwen2"
    source = family_checkpoint(tiny_checkpoint, {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}[family])
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update({k: v for k, v in fields.items() if k != "_drop"})
    raw.pop(fields.get("_drop", "-"), None)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        Llama.from_pretrained(folder)


def test_qwen_window_off_or_below_max_window_layers_runs():
    """Qwen2.5's configs name a sliding_window with use_sliding_window false: no window, as in transformers."""
    as_shipped = raw_config("qwen2", use_sliding_window=False, sliding_window=128, max_window_layers=21)
    assert LlamaConfig.from_dict(as_shipped).qkv_bias
    LlamaConfig.from_dict(raw_config("qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=2))


# the fields of released config.json files that matter here (Qwen2.5-0.5B-Instruct, Qwen3-0.6B, Mistral-7B v0.3, v0.1)
QWEN25 = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=21, rope_theta=1e6,
              rope_scaling=None, sliding_window=32768, use_sliding_window=False, tie_word_embeddings=True,
              vocab_size=151936, rms_norm_eps=1e-6, hidden_act="silu")
QWEN3 = dict(model_type="qwen3", attention_bias=False, head_dim=128, hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=40960,
             max_window_layers=28, rope_scaling=None, rope_theta=1e6, sliding_window=None, use_sliding_window=False,
             tie_word_embeddings=True, vocab_size=151936, rms_norm_eps=1e-6, hidden_act="silu")
MISTRAL_V03 = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6,
                   sliding_window=None, vocab_size=32768, rms_norm_eps=1e-5, hidden_act="silu")


@pytest.mark.parametrize("raw, expected", [
    (QWEN25, dict(head_dim=64, qkv_bias=True, o_bias=False, qk_norm=False, tie_word_embeddings=True)),
    (QWEN3, dict(head_dim=128, qkv_bias=False, o_bias=False, qk_norm=True, tie_word_embeddings=True)),
    (MISTRAL_V03, dict(head_dim=128, qkv_bias=False, o_bias=False, qk_norm=False, tie_word_embeddings=False)),
], ids=["qwen2.5", "qwen3", "mistral-v0.3"])
def test_released_configs_read_as_their_architecture(raw, expected):
    config = LlamaConfig.from_dict(raw)
    assert {name: getattr(config, name) for name in expected} == expected
    assert config.rope.theta == 1e6 and config.max_position_embeddings == raw["max_position_embeddings"]


def test_mistral_v01_window_is_refused():
    with pytest.raises(ConfigError, match="sliding_window 4096 is smaller than max_position_embeddings 32768"):
        LlamaConfig.from_dict({**MISTRAL_V03, "sliding_window": 4096})
