"""Checkpoints that must be refused at load with an error naming the field, tensor or file, and the tie rule."""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from lookahead.models import CheckpointError, ConfigError, Llama

IDS = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(11))


def copy_checkpoint(folder, tmp_path, name="ckpt"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def edit_json(folder, file, edit):
    path = folder / file
    raw = json.loads(path.read_text()) if path.is_file() else {}
    replaced = edit(raw)
    if isinstance(replaced, list):  # a list-shaped file replaces the object
        raw = replaced
    path.write_text(json.dumps(raw))
    return folder


def old_rope(theta):
    def edit(raw):
        raw.pop("rope_parameters", None)
        raw["rope_theta"] = theta
    return edit


CONFIG_CASES = {
    "tie-string": (lambda raw: raw.update(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    "bias-int": (lambda raw: raw.update(attention_bias=1), "'attention_bias' must be true or false"),
    "mlp-bias-null": (lambda raw: raw.update(mlp_bias=None), "'mlp_bias' must be true or false"),
    "vocab-string": (lambda raw: raw.update(vocab_size="101"), "'vocab_size' must be a positive int"),
    "hidden-float": (lambda raw: raw.update(hidden_size=64.0), "'hidden_size' must be a positive int"),
    "layers-bool": (lambda raw: raw.update(num_hidden_layers=True), "'num_hidden_layers' must be a positive int"),
    "kv-heads-0": (lambda raw: raw.update(num_key_value_heads=0), "'num_key_value_heads' must be a positive int"),
    "head-dim-string": (lambda raw: raw.update(head_dim="16"), "'head_dim' must be a positive int"),
    "max-pos-negative": (lambda raw: raw.update(max_position_embeddings=-1),
                         "'max_position_embeddings' must be a positive int"),
    "missing-layers": (lambda raw: raw.pop("num_hidden_layers"), "'num_hidden_layers' is required"),
    "vocab-2**31": (lambda raw: raw.update(vocab_size=2**31), "'vocab_size' is 2147483648, larger than any model's"),
    "intermediate-2**40": (lambda raw: raw.update(intermediate_size=2**40), "'intermediate_size' is 1099511627776"),
    "eps-negative": (lambda raw: raw.update(rms_norm_eps=-1), "'rms_norm_eps' must be a finite number > 0"),
    "eps-zero": (lambda raw: raw.update(rms_norm_eps=0), "'rms_norm_eps' must be a finite number > 0"),
    "eps-string": (lambda raw: raw.update(rms_norm_eps="1e-6"), "'rms_norm_eps' must be a finite number > 0"),
    "theta-0-old": (old_rope(0), "'rope_theta' must be a finite number > 0"),
    "theta-0-new": (lambda raw: raw.update(rope_parameters={"rope_type": "default", "rope_theta": 0}),
                    r"rope_parameters\['rope_theta'\] must be a finite number > 0"),
    "linear-factor-0": (lambda raw: raw.update(rope_parameters={"rope_type": "linear", "factor": 0, "rope_theta": 1e4}),
                        r"rope_parameters\['factor'\] must be a finite number > 0"),
    "linear-factor-0-old": (lambda raw: (old_rope(1e4)(raw), raw.update(rope_scaling={"type": "linear", "factor": 0})),
                            r"rope_scaling\['factor'\] must be a finite number > 0"),
    "llama3-high-le-low": (lambda raw: raw.update(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 5e5}), r"\['high_freq_factor'\] \(4.0\) must exceed"),
    "rope-params-string": (lambda raw: raw.update(rope_parameters="default"), "'rope_parameters' must be an object"),
    # issue 28 item 8: 1e-300 loaded and gave token 0 every step (the frequencies overflow)
    "theta-1e-300": (old_rope(1e-300), r"'rope_theta' must be a number in \(1, 1e\+12\] .*got 1e-300"),
    "theta-1": (old_rope(1), r"'rope_theta' must be a number in \(1, 1e\+12\] .*got 1.0"),
    "theta-1e300-new": (lambda raw: raw.update(rope_parameters={"rope_type": "default", "rope_theta": 1e300}),
                        r"'rope_theta' must be a number in \(1, 1e\+12\] .*got 1e\+300"),
    "eos-string": (lambda raw: raw.update(eos_token_id="12"), "eos_token_id must be an int or a list of ints"),
    "eos-bool-list": (lambda raw: raw.update(eos_token_id=[True]), "eos_token_id must be an int or a list of ints"),
    "list-json": (lambda raw: [raw], "must hold a JSON object, got list"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_field_of_wrong_type_or_range_is_refused(tiny_checkpoint, tmp_path, case):
    edit, message = CONFIG_CASES[case]
    folder = copy_checkpoint(tiny_checkpoint("gqa"), tmp_path)
    (folder / "generation_config.json").unlink()  # the config's own eos_token_id is read
    edit_json(folder, "config.json", edit)
    with pytest.raises(ConfigError, match=message):
        Llama.from_pretrained(folder)


@pytest.mark.parametrize("value, message", [
    ("12", "generation_config.json eos_token_id must be an int or a list of ints, got '12'"),
    ([True], r"generation_config.json eos_token_id must be an int or a list of ints, got \[True\]"),
    ([2, -1], "generation_config.json eos_token_id must hold token ids >= 0"),
])
def test_generation_config_eos_is_type_checked(tiny_checkpoint, tmp_path, value, message):
    folder = edit_json(copy_checkpoint(tiny_checkpoint("gqa"), tmp_path), "generation_config.json",
                       lambda raw: raw.update(eos_token_id=value))
    with pytest.raises(ConfigError, match=message):
        Llama.from_pretrained(folder)


def test_list_shaped_generation_config_and_bad_json_are_refused(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("gqa"), tmp_path)
    (folder / "generation_config.json").write_text("[2]")
    with pytest.raises(ConfigError, match="generation_config.json must hold a JSON object, got list"):
        Llama.from_pretrained(folder)
    (folder / "generation_config.json").unlink()
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        Llama.from_pretrained(folder)


def rewrite_weights(folder, tmp_path, name, edit):
    target = copy_checkpoint(folder, tmp_path, name)
    weights = load_file(target / "model.safetensors")
    edit(weights)
    save_file(weights, target / "model.safetensors")
    return target


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny_checkpoint, tmp_path, bad):
    def poison(weights):
        weights["model.layers.1.mlp.down_proj.weight"][3, 5] = bad

    folder = rewrite_weights(tiny_checkpoint("gqa"), tmp_path, "poisoned", poison)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.down_proj.weight' .* holds NaN or inf"):
        Llama.from_pretrained(folder)


def test_weights_too_large_for_float16_are_refused(tiny_checkpoint, tmp_path):
    def enlarge(weights):
        weights["model.norm.weight"][0] = 1e6

    folder = rewrite_weights(tiny_checkpoint("gqa"), tmp_path, "large", enlarge)
    Llama.from_pretrained(folder)  # fine in float32
    with pytest.raises(CheckpointError, match="'model.norm.weight' overflows torch.float16"):
        Llama.from_pretrained(folder, dtype="float16")


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("sharded", max_shard_size="60KB"), tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    return folder, index


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors", ""])
def test_index_may_name_only_files_inside_the_folder(sharded, name):
    folder, index = sharded
    index["weight_map"]["model.norm.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="only files inside the checkpoint folder"):
        Llama.from_pretrained(folder)


def test_tensor_in_a_shard_the_index_does_not_assign_it_to_is_refused(sharded):
    folder, index = sharded
    name = "model.layers.0.mlp.up_proj.weight"
    home = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    weights = load_file(folder / other)
    weights[name] = torch.zeros_like(load_file(folder / home)[name])  # a second, wrong copy
    save_file(weights, folder / other)
    with pytest.raises(CheckpointError, match=f"'{name}' is in {other}, but .* does not assign it"):
        Llama.from_pretrained(folder)


def test_index_without_a_weight_map_object_is_refused(sharded):
    folder, _ = sharded
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(CheckpointError, match="'weight_map' must be an object"):
        Llama.from_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        Llama.from_pretrained(folder)


def hf_logits(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def test_tied_config_with_a_different_head_in_the_file_keeps_the_head_like_transformers(tiny_checkpoint, tmp_path):
    """transformers 5 (`tie_weights` during from_pretrained): both present and different -> not tied, warns."""
    folder = copy_checkpoint(tiny_checkpoint("gqa"), tmp_path)  # saved untied: both tensors in the file
    edit_json(folder, "config.json", lambda raw: raw.update(tie_word_embeddings=True))
    expected = hf_logits(folder)
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        model = Llama.from_pretrained(folder)
    assert (model(IDS) - expected).abs().max().item() < 1e-4
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_config_with_only_the_head_in_the_file_ties_to_it_like_transformers(tiny_checkpoint, tmp_path):
    """transformers 5: the tie source (embed_tokens) missing but the head present -> both use the head."""
    folder = rewrite_weights(tiny_checkpoint("gqa"), tmp_path, "head-only",
                             lambda w: w.pop("model.embed_tokens.weight"))
    edit_json(folder, "config.json", lambda raw: raw.update(tie_word_embeddings=True))
    expected = hf_logits(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Llama.from_pretrained(folder)
    assert (model(IDS) - expected).abs().max().item() < 1e-4


def test_tied_config_with_an_equal_head_in_the_file_stays_tied(tiny_checkpoint, tmp_path):
    def duplicate(weights):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()

    folder = rewrite_weights(tiny_checkpoint("tied", tie_word_embeddings=True), tmp_path, "equal", duplicate)
    expected = hf_logits(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Llama.from_pretrained(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model(IDS) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("path, error, message", [
    ("", ValueError, "path must name a checkpoint folder"),
    (None, TypeError, "path must be a checkpoint folder"),
])
def test_empty_or_missing_path_is_refused(path, error, message):
    with pytest.raises(error, match=message):
        Llama.from_pretrained(path)


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", torch.device("meta")], ids=["meta", "mps", "xpu", "meta-dev"])
def test_devices_other_than_cpu_and_cuda_are_refused(tiny_checkpoint, device):
    with pytest.raises(ValueError, match=f"device '{device}' is not supported: the model runs on 'cpu' or 'cuda'"):
        Llama.from_pretrained(tiny_checkpoint("gqa"), device=device)


def test_cuda_device_without_cuda_is_one_clear_error(tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        Llama.from_pretrained(tiny_checkpoint("gqa"), device="cuda")
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device"):
        Llama.from_pretrained(tiny_checkpoint("gqa"), device="gpu")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool], ids=str)
def test_integer_or_bool_weights_are_refused_naming_the_tensor(tiny_checkpoint, tmp_path, dtype):
    """copy_ into a float parameter would convert them silently (a bool norm weight becomes 0.0 and 1.0)."""
    def to_integer(weights):
        weights["model.layers.0.post_attention_layernorm.weight"] = torch.ones(64, dtype=dtype)

    folder = rewrite_weights(tiny_checkpoint("gqa"), tmp_path, "integer", to_integer)
    with pytest.raises(CheckpointError, match=rf"'model.layers.0.post_attention_layernorm.weight' .* holds "
                                              rf"{dtype} values, not floating point"):
        Llama.from_pretrained(folder)


@pytest.mark.parametrize("field, message", [
    # vocab_size 2**30 with a 101-token file would allocate 2 x 256 GiB before the shapes were compared
    ("vocab_size", r"'lm_head.weight' has shape \(101, 64\), the model expects \(1073741824, 64\) \(does config.json "
                   r"match the weights\?\)"),
    # building 2**30 layers (even on the meta device) would take hours: the count is checked against the names
    ("num_hidden_layers", "config.json sets num_hidden_layers 1073741824, but the checkpoint in .* holds 2 layer"),
])
def test_config_sizes_the_weights_do_not_have_are_refused_before_allocating(tiny_checkpoint, tmp_path, field,
                                                                              message):
    folder = edit_json(copy_checkpoint(tiny_checkpoint("gqa"), tmp_path), "config.json",
                       lambda raw: raw.update({field: 2**30}))
    with pytest.raises(CheckpointError, match=message):
        Llama.from_pretrained(folder)
