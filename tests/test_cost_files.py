"""The cost model's files and values, where users and machines hand it bad ones: an unwritable cache folder (issue 28
item 3), cost files that are not what `save` writes (item 4), values of the wrong type (items 5, 13), the cost per
position learned from the steps (item 12), one adapter home (item 11) and the suite's own cache (item 18)."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CACHE_ROOT

import lookahead.hf as lh
import lookahead.hf.tuning as hf_tuning
from lookahead import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.models import Llama
from lookahead.models import tuning as model_tuning
from lookahead.tuning import CostModel, Curve, fit, store
from lookahead.tuning import cost as cost_module
from lookahead.tuning import measure as shared

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache root for the test (LOOKAHEAD_CACHE_DIR), and warnings said afresh. The CPU kernels' build is
    loaded first, from the suite's cache: one that fails in a damaged root would stay failed for the process."""
    from lookahead.kernels import cpu_kernels

    cpu_kernels.available(Path(CACHE_ROOT) / "kernels")
    root = tmp_path / "cache"
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(root))
    monkeypatch.setattr(store, "_WARNED", set(), raising=False)
    return root


def count_measures(monkeypatch) -> list:
    measured = []
    real = model_tuning.measure
    monkeypatch.setattr(model_tuning, "measure", lambda *a: measured.append(1) or real(*a))
    return measured


def saved_cost(model: Llama) -> Path:
    """The cost file of the model's key (the model has generated self-tuned once)."""
    return store.cost_path(model.cost_model.key)


# ---- item 3: an unwritable cache is an optimisation lost, never a generation -----------------------------------------


def test_an_unwritable_cache_measures_in_memory_says_so_once_and_generates(tiny_checkpoint, cache, monkeypatch):
    """The cache root is a file (root can write anywhere else): mkdir fails under it as a read-only folder would."""
    cache.write_text("not a folder")
    measured = count_measures(monkeypatch)
    model = Llama.from_pretrained(tiny_checkpoint())
    plain = model.generate(PROMPT, max_new_tokens=12, eos_token_id=[]).tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            result = model.generate(PROMPT, max_new_tokens=12, eos_token_id=[], lookahead=LookaheadConfig())
            assert result.tokens == plain
    said = [w for w in caught if "cannot keep the measured step costs" in str(w.message)]
    assert len(said) == 1 and "LOOKAHEAD_CACHE_DIR" in str(said[0].message)
    assert measured == [1] and "greedy" in model.cost_model.curves  # measured once, kept in memory


def test_a_failing_write_after_the_tokens_never_loses_the_result(tiny_checkpoint, cache, monkeypatch):
    """With a good cost file the generation streamed every token, then the periodic save in `generate`'s finally
    raised PermissionError and the result was lost."""
    first = Llama.from_pretrained(tiny_checkpoint())
    first.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    assert saved_cost(first).is_file()

    def denied(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(CostModel, "save", denied)
    monkeypatch.setattr(store, "SAVE_EVERY", 0.0)
    model = Llama.from_pretrained(tiny_checkpoint())
    streamed = []
    with pytest.warns(RuntimeWarning, match=r"cannot keep the measured step costs in .* \(Permission denied\)"):
        result = model.generate(PROMPT, max_new_tokens=12, eos_token_id=[], lookahead=LookaheadConfig(),
                                stream=streamed.extend)
    assert result.tokens == streamed and len(streamed) == 12


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the tests above stand in for it")
def test_a_read_only_cache_folder(tiny_checkpoint, cache):
    cache.mkdir()
    cache.chmod(0o555)
    try:
        model = Llama.from_pretrained(tiny_checkpoint())
        with pytest.warns(RuntimeWarning, match="Permission denied"):
            model.generate(PROMPT, max_new_tokens=6, lookahead=LookaheadConfig())
    finally:
        cache.chmod(0o755)


def test_the_transformers_adapter_generates_with_an_unwritable_cache(tiny_checkpoint, cache):
    from transformers import LlamaForCausalLM

    cache.write_text("not a folder")
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).eval()
    with pytest.warns(RuntimeWarning, match="cannot keep the measured step costs"):
        result = lh.generate(model, PROMPT, 6, LookaheadConfig(), eos_token_id=[])
    assert len(result.tokens) == 6 and "greedy" in lh.model_state(model).cost_model.curves


# ---- item 4: a cost file is read bounded, parsed defensively, and measured again when it is not ours --------------


def good_file(path: Path) -> dict:
    cost = CostModel({"greedy": fit([(t, 0, 0.01 * t + 0.05) for t in (1, 4, 18)])}, key={"k": 1})
    cost.save(path)
    return json.loads(path.read_text())


@pytest.mark.parametrize("damage", ["nested", "oversized", "folder", "dev-zero", "fifo", "knot 10**40", "knot 1.7",
                                    "knot true", 'knot "2"', "base true", "format true", "key list", "not utf-8"])
def test_a_cost_file_that_is_not_ours_is_not_trusted(tmp_path, damage):
    path = tmp_path / "c.json"
    data = good_file(path)
    knots = data["curves"]["greedy"]["knots"]
    path.unlink()
    if damage == "nested":
        path.write_text("[" * 100_000)  # json.loads raised RecursionError, in every later generation
    elif damage == "oversized":
        path.write_text(json.dumps(data) + " " * cost_module.MAX_FILE_BYTES)  # valid JSON, but no file of ours
    elif damage == "folder":
        path.mkdir()
    elif damage == "dev-zero":
        path.symlink_to("/dev/zero")  # read without bound: 2.3 GB in 60 s
    elif damage == "fifo":
        os.mkfifo(path)  # no writer: a blocking open would wait forever
    elif damage == "not utf-8":
        path.write_bytes(b'{"format": 1, "key": {"\xff": 1}}')
    else:
        if damage.startswith("knot"):  # each once read as a knot (int(1.7) == 1, int("2") == 2, int(True) == 1)
            index, value = {"knot 10**40": (-1, 10**40), "knot 1.7": (0, 1.7), "knot true": (0, True),
                            'knot "2"': (1, "2")}[damage]
            knots[index] = value
            if damage == "knot true":
                knots[:] = [True]
                data["curves"]["greedy"]["base"] = [0.05]
                data["curves"]["greedy"]["per_position"] = [0.0]
        elif damage == "base true":
            data["curves"]["greedy"]["base"][0] = True
        elif damage == "format true":
            data["format"] = True
        elif damage == "key list":
            data["key"] = [1]
        path.write_text(json.dumps(data))
    start = time.perf_counter()
    assert CostModel.load(path) is None and CostModel.load(path, {"k": 1}) is None
    assert time.perf_counter() - start < 2.0


def test_a_nested_cost_file_is_measured_again_and_replaced(tiny_checkpoint, cache, monkeypatch):
    measured = count_measures(monkeypatch)
    first = Llama.from_pretrained(tiny_checkpoint())
    first.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    path = saved_cost(first)
    path.write_text("[" * 100_000)
    for _ in range(2):  # every later generation used to raise RecursionError
        model = Llama.from_pretrained(tiny_checkpoint())
        model.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    assert measured == [1, 1] and CostModel.load(path, first.cost_model.key) is not None


def test_a_cost_path_that_is_a_folder_is_measured_in_memory(tiny_checkpoint, cache, monkeypatch):
    first = Llama.from_pretrained(tiny_checkpoint())
    first.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    path = saved_cost(first)
    path.unlink()
    path.mkdir()
    measured = count_measures(monkeypatch)
    model = Llama.from_pretrained(tiny_checkpoint())
    with pytest.warns(RuntimeWarning, match="cannot keep the measured step costs"):
        model.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    assert measured == [1] and path.is_dir()


# ---- items 5 and 13: values of the wrong type are refused where they are set, naming the field -------------------


def test_curves_refuse_what_no_measurement_gives():
    with pytest.raises(TypeError, match=r"Curve.knots must hold ints \(token counts\), got str '1'"):
        Curve(["1"], [1.0], [0.0])
    with pytest.raises(TypeError, match=r"Curve.base must hold numbers \(seconds\), got str 'x'"):
        Curve([1], ["x"], [0.0])
    with pytest.raises(TypeError, match="Curve.knots must hold ints .*float 1.5"):
        Curve([1.5], [1.0], [0.0])
    with pytest.raises(TypeError, match="Curve.per_position must hold numbers .*bool True"):
        Curve([1], [1.0], [True])
    with pytest.raises(TypeError, match="Curve.base must be a list, got str"):
        Curve([1], "1.0", [0.0])
    with pytest.raises(ValueError, match="Curve.base must hold finite costs of at least"):
        Curve([1], [0.0], [0.0])  # a zero base divided by zero (1 / t)
    with pytest.raises(ValueError, match="Curve.base must hold finite costs of at least"):
        Curve([1], [1e-320], [0.0])  # 1 / 1e-320 is inf
    with pytest.raises(ValueError, match=r"Curve.knots must be increasing token counts in 1..1048576, got \[1, 10000"):
        Curve([1, 10**40], [1.0, 2.0], [0.0, 0.0])
    assert Curve((1, 4), (1, 2.0), (0, 0)).knots == [1, 4]  # tuples and ints are fine


def test_a_cost_model_or_memory_of_the_wrong_type_is_refused_when_set(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint())
    with pytest.raises(TypeError, match="cost_model must be a lookahead.tuning.CostModel or None, got str"):
        model.cost_model = "fast"
    with pytest.raises(TypeError, match="draft_memory must be a lookahead.drafts.DraftMemory, got dict"):
        model.draft_memory = {}
    with pytest.raises(TypeError, match=r"CostModel.curves\['greedy'\] must be a Curve, got dict"):
        CostModel({"greedy": {"knots": [1]}})
    with pytest.raises(ValueError, match="CostModel.curves: kinds are"):
        CostModel({"fast": Curve([1], [1.0], [0.0])})
    broken = CostModel({"greedy": Curve([1, 8], [1.0, 2.0], [0.0, 0.0])})
    broken.curves["greedy"].base[0] = 0.0  # changed after it was built
    with pytest.raises(ValueError, match="Curve.base must hold finite costs"):
        model.cost_model = broken
    model.draft_memory = DraftMemory(cap_tokens=64)
    model.cost_model = CostModel({"greedy": Curve([1, 64], [1.0, 1.0], [0.0, 0.0])})
    assert model.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig()).tokens
    model.cost_model = None
    assert model.cost_model is None


def test_the_transformers_state_refuses_a_cost_model_of_the_wrong_type():
    state = hf_tuning.ModelState()
    with pytest.raises(TypeError, match="cost_model must be a lookahead.tuning.CostModel or None, got int"):
        state.cost_model = 3
    with pytest.raises(TypeError, match="cost_model must be a lookahead.tuning.CostModel or None, got str"):
        hf_tuning.ModelState("x")


# ---- item 12: the cost per position is learned from the steps, and measured on the transformers side too -----------


def test_steps_at_other_lengths_teach_the_cost_per_position():
    """A curve measured at one cache length only has no cost per position; steps at the lengths generations run
    (growing from prompts of many lengths) teach it, so a short prompt after long ones is not judged by them."""
    import random

    true = lambda t, L: 0.02 + 0.002 * t + 4e-5 * L * (1 + 0.1 * t)  # noqa: E731
    curve = fit([(t, 0, true(t, 0)) for t in (1, 2, 4, 8, 16, 18)])
    assert curve.per_position == [0.0] * 6
    rng = random.Random(0)
    for _ in range(12):
        length = rng.randrange(20, 1500)
        for _ in range(60):
            t = rng.choice([1, 1, 4, 8, 18])
            curve.observe(t, length, true(t, length))
            length += rng.randrange(1, 4)
    assert all(p > 0 for p in curve.per_position)
    for t in (1, 8, 18):
        for length in (50, 800, 2000):
            assert curve.predict(t, length) == pytest.approx(true(t, length), rel=0.2), (t, length)


def test_the_transformers_adapter_times_two_cache_lengths(tiny_checkpoint, cache, monkeypatch):
    from transformers import LlamaForCausalLM

    samples = []
    real_fit = shared.fit
    monkeypatch.setattr(shared, "fit", lambda s: samples.extend(s) or real_fit(samples))
    monkeypatch.setattr(hf_tuning, "interpreting", lambda: False)  # the suite runs Triton interpreted: quick timing
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    result = lh.generate(model, PROMPT, 10, LookaheadConfig(), eos_token_id=[])
    assert result.tokens == expected  # the placeholders were cropped away: nothing the generation computes changed
    lengths = sorted({length for _, length, _ in samples})
    assert lengths[0] == 0 and lengths[-1] >= shared.MIN_SPAN


# ---- item 11: one home for what both adapters do ---------------------------------------------------------------


def test_both_adapters_go_through_the_shared_measurement(tiny_checkpoint, cache, monkeypatch):
    from transformers import LlamaForCausalLM

    calls = []
    real = shared.time_steps
    monkeypatch.setattr(shared, "time_steps", lambda run, sizes, *a: calls.append(sizes) or real(run, sizes, *a))
    ours = Llama.from_pretrained(tiny_checkpoint())
    ours.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    hf_model = LlamaForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).eval()
    lh.generate(hf_model, PROMPT, 4, LookaheadConfig(), eos_token_id=[])
    assert len(calls) == 2
    keys = ours.cost_model.key, lh.model_state(hf_model).cost_model.key
    common = {"device", "dtype", "backend", "threads", "interpreted", "model", "versions"}
    assert all(common <= set(key) for key in keys)
    assert keys[0]["versions"][:3] == keys[1]["versions"][:3]  # torch, triton, lookahead: read one way


def test_a_cost_file_belongs_to_the_build_of_the_cpu_kernels_that_ran(tiny_checkpoint, cache, monkeypatch,
                                                                       tmp_path):
    """Costs measured on one version of the compiled CPU kernels are not another's (a faster GEMM makes larger steps
    pay): the key names the build where the batch-invariant mode runs on it, and nothing where the mode is off."""
    from lookahead.kernels import cpu_kernels

    model = Llama.from_pretrained(tiny_checkpoint())
    model.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    assert model.batch_invariant and model.cost_model.key["kernels"] == cpu_kernels.build_name()
    another = tmp_path / "csrc"  # the kernels' sources, one of them changed
    shutil.copytree(cpu_kernels.CSRC, another)
    with open(another / cpu_kernels.SOURCE_FILES[-1], "a") as f:
        f.write("// another version\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", another)
    assert cpu_kernels.build_name() != model.cost_model.key["kernels"]
    off = Llama.from_pretrained(tiny_checkpoint(), batch_invariant=False)
    off.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig())
    assert off.cost_model.key["kernels"] is None


# ---- item 18: the suite's cost files stay out of the user's cache -------------------------------------------------


def test_the_suite_writes_no_cost_file_into_the_users_cache():
    folder = store.cache_dir()
    assert folder is not None and Path(CACHE_ROOT) in folder.parents
    assert Path.home() / ".cache" / "lookahead" not in (folder, *folder.parents)


def test_measuring_shows_its_rounds_and_stops_repeating_past_its_budget(capsys):
    """A machine where every pass takes 4 s (a fake clock): the preparing round and the first timed pass at each
    length run, the repeats do not (a first start took a minute, silently); each round is a progress line."""
    from lookahead.cli import _show_progress

    now, calls = [0.0], []

    def run(i, length):
        calls.append((i, length))
        now[0] += 4.0

    _show_progress()
    curve = shared.time_steps(run, shared.Passes([1, 2, 4], 1, 1000, False), clock=lambda: now[0])
    assert calls == [(0, 0), (1, 0), (2, 0)] + [(i, 0) for i in range(3)] + [(i, 1000) for i in range(3)]
    assert curve.knots == [1, 2, 4]
    err = capsys.readouterr().err
    assert "lookahead: measuring what a step costs on this machine" in err and "round 3 of 5" in err
    assert "36 s spent; the rest is learned from the steps" in err
    now[0], calls[:] = 0.0, []
    shared.time_steps(lambda i, length: calls.append((i, length)), shared.Passes([1, 2], 1, 1000, False),
                      clock=lambda: now[0])
    assert len(calls) == 2 * (1 + shared.REPEATS + 1)  # a fast machine: every repeat
