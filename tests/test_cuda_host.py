"""The suite on a CUDA host, reproduced on a CPU: with CUDA visible, conftest leaves Triton's interpreter off, so a test
that runs Triton kernels on CPU tensors fails there unless it skips (`helpers.needs_interpreter`), and a kernel test
on `DEVICE` runs on the GPU (`helpers.needs_triton` skips it only where neither exists). A sample of each kind runs in
a subprocess with TRITON_INTERPRET=0: every one must skip, none fail (issue 38: 32 tests once failed this way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# one test (or module) of each kind that broke: the Triton backend, the fusion, the graph emulator's runner, the
# kernel-compile counter, a parametrised backend, and the kernel tests on DEVICE
SAMPLE = [
    "test_batch.py::test_triton_backend_batch",
    "test_fusion.py::test_fused_lookahead_decoding_equals_plain_greedy",
    "test_graph_emulator.py::test_step_region_is_capturable_and_replays_as_eager",
    "test_graph_emulator.py::test_op_budget_of_an_8b_shaped_step[fused-default-1-4-5]",
    "test_static_step.py::test_a_static_generation_compiles_the_kernel_once",
    "test_engine.py::test_tiny_llama_rows_joining_a_running_batch_equal_each_alone[triton]",
    "test_smoke.py::test_kernel_matches_reference",
    "test_fused.py",
    "test_paged_kernel.py::test_mixed_batch_matches_reference",
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the suite itself is this check")
def test_tests_that_need_the_interpreter_skip_where_it_is_off():
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          *(str(TESTS / node) for node in SAMPLE)], capture_output=True, text=True, env=env,
                         cwd=TESTS.parent, timeout=300)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "error" not in summary, summary
