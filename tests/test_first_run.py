"""bench/gpu_first_run.sh, the first GPU run (issue 38), proved on a CPU: its dry run (tiny shapes) starts, writes
every part's figures as JSON lines and ends within its budget; a run out of time skips the parts it cannot start; a
part stops itself at its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_first_run.sh"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's stand-in for a GPU run")


def dry_run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=240)
    seconds = time.monotonic() - start
    lines = [json.loads(line) for line in (out / "first-run.jsonl").read_text().splitlines()]
    return run, lines, seconds


def test_dry_run_measures_every_part_and_ends_within_its_budget(tmp_path):
    run, lines, seconds = dry_run(tmp_path)  # about 30 s on 2 idle cores; its budget, 90 s, leaves room for load
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert seconds < 90 + 5, seconds
    events = {(x["part"], x["event"]) for x in lines if "event" in x}
    assert {("a", "done"), ("b", "done"), ("c", "done"), ("d", "done"), ("e", "done"), ("setup", "end")} <= events
    kinds = {(x["part"], x["kind"]) for x in lines if "kind" in x}
    assert {("a", "step"), ("b", "summary"), ("c", "engine")} <= kinds, kinds
    assert ("d", "skipped") in kinds or ("d", "step") in kinds, kinds  # the batch-invariant mode, where merged
    steps = [x for x in lines if x.get("kind") == "step" and x["part"] == "a"]
    plain = [x for x in steps if x["config"] == "plain"]
    assert plain and all(x["runner"] == "plain" for x in plain)  # plain decoding on its own runner
    sizes = {x["padded"] for x in steps if x["runner"] == "lookahead"}
    assert {x["padded"] for x in steps if x["config"].startswith("path")} == sizes  # every padded size measured
    assert all(x["ms"] > 0 for x in steps)
    tests = next(x for x in lines if x.get("event") == "tests")
    assert "collected" in tests["detail"], tests  # the GPU test list exists and imports
    assert (tmp_path / "first-run.log").stat().st_size > 0


def test_a_run_out_of_time_skips_the_parts_it_cannot_start(tmp_path):
    run, lines, seconds = dry_run(tmp_path, "--budget", "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    skipped = [x["part"] for x in lines if x.get("event") == "skipped"]
    assert skipped == ["a", "b", "c", "d", "e"], lines
    assert seconds < 3 + 10, seconds  # the setup's one import check, then nothing


def test_a_part_stops_itself_at_its_budget(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import first_run

    out = first_run.Out(tmp_path / "lines.jsonl", "a", budget=0.0, dry=True)
    first_run.part_step_time(out)
    lines = [json.loads(line) for line in (tmp_path / "lines.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["model", "plan", "stopped"], lines


def test_gpu_step_times_static_steps_and_plain_on_its_own_runner(monkeypatch):
    """bench/gpu_step.py's step table (issue 38): each step static (padded to its bucket, graphed on CUDA), not the
    Request's default exact-size eager step; plain on a runner sized for one-token steps."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_step

    monkeypatch.setattr(gpu_step, "GPU", True)  # a CPU runs static steps too (padded, without graphs)
    model = gpu_step.random_llama(gpu_step.SMALL, torch.float32, "cpu")
    gpu_step.step_seconds(model, None, 32, repeats=1)
    assert model.runner.static and model.runner.max_step_tokens == 1
    assert [shape.tokens for shape in model.runner.step_shapes] == [8]  # plain, padded to the smallest bucket
    model.release()
    gpu_step.step_seconds(model, gpu_step.STEP_CONFIGS["1-4-5"], 32, repeats=1)
    assert model.runner.static and [shape.tokens for shape in model.runner.step_shapes] == [32]  # T = 18, padded


def test_gpu_step_logs_and_replays_the_budgets_choices_beside_prompt_chunks(monkeypatch):
    """bench/gpu_step.py's choice log wraps `StepBudget.choose` as the scheduler calls it (the step without its prompt
    chunks included), and its replay sizes every logged step again."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_step

    from helpers import MockRowModel
    from lookahead import LookaheadConfig
    from lookahead.loop import Engine
    from lookahead.request import GREEDY, Request
    from lookahead.tuning import CostModel, Curve

    def cost() -> CostModel:
        return CostModel({"greedy": Curve([1, 256], [0.02, 0.02 + 0.001 * 255], [0.0, 0.0])})

    engine = Engine(MockRowModel(32, prefill_chunk=8), cost=cost())
    with gpu_step.ChoiceLog() as log:
        engine.submit(Request([[3, 1, 4, 1, 5, 9, 2, 6]], 16, GREEDY, LookaheadConfig(), frozenset()))
        for _ in range(3):
            engine.step()
        engine.submit(Request([[2, 7] * 12], 16, GREEDY, LookaheadConfig(), frozenset()))  # chunked beside it
        while engine.step():
            pass
    assert any(step["steady"] is not None for step in log.steps)
    assert sum(gpu_step.replay(log.steps, cost()).values()) == len(log.steps)


def test_batch_invariant_part_times_both_modes_where_the_model_has_them(tmp_path, monkeypatch):
    """Part (d) feature-detects `Llama(..., batch_invariant=...)`: with it (a stand-in here), a plain and a lookahead
    step timed in the default forward and the unfused one (and, on a GPU, the mode)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import first_run

    import lookahead.models

    class Invariant(lookahead.models.Llama):
        def __init__(self, config, attn_backend="torch", fusion="none", batch_invariant=False):
            super().__init__(config, attn_backend, fusion)
            self.invariant = batch_invariant

    monkeypatch.setattr(lookahead.models, "Llama", Invariant)
    monkeypatch.setattr(first_run, "Llama", Invariant)
    first_run.part_batch_invariant(first_run.Out(tmp_path / "lines.jsonl", "d", budget=60.0, dry=True))
    lines = [json.loads(line) for line in (tmp_path / "lines.jsonl").read_text().splitlines()]
    steps = {(x["mode"], x["config"]) for x in lines if x["kind"] == "step"}
    assert steps == {(mode, config) for mode in ("default", "unfused") for config in ("plain", "1-4-5")}
    assert [x["mode"] for x in lines if x["kind"] == "skipped"] == ["invariant"]  # a CPU compiles it: not dry
