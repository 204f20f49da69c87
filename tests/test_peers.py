"""bench/peers.py's quick path (issue 36 item 3): our plain and lookahead servers on a tiny model, through their
OpenAI endpoints, in CI where llama.cpp and vLLM are not installed: it skips them, saying why, and measures ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_run_measures_our_servers_and_names_the_peers_it_skipped(served_dir, tmp_path):
    no_llama = tmp_path / "python-without-llama-cpp"  # any Python where `import llama_cpp.server` fails
    no_llama.write_text("#!/bin/sh\nexit 1\n")
    no_llama.chmod(0o755)
    run = subprocess.run([sys.executable, "bench/peers.py", "--quick", "--model", str(served_dir), "--dtypes",
                          "float32", "--no-llama-server", "--llama-python", str(no_llama), "--vllm",
                          str(tmp_path / "no-vllm")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PATH": os.path.dirname(sys.executable)})  # no aiperf, no vllm on PATH
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tables = [line.split("|") for line in run.stdout.splitlines() if line.startswith("ours ")]
    rows = [row for row in tables if len(row) == 10]  # the load's table (the prefill's has 6 columns)
    measured = {(row[0].strip(), row[2].strip()) for row in rows}
    assert measured == {(f"ours {method}", c) for method in ("plain", "lookahead") for c in ("1", "2")}
    for row in rows:
        assert float(row[3]) > 0  # tokens/s
        if row[0].strip() == "ours lookahead":  # greedy: the lookahead server answers as the plain one
            same, total = map(int, row[8].split("/"))
            assert same == total > 0
    prefill = [row for row in tables if len(row) == 6]  # engine, dtype, prompt tokens, seconds, tokens/s, ratio
    assert [(row[0].strip(), row[2].strip()) for row in prefill] == [("ours plain", "64")]
    assert len(prefill) == 1 and float(prefill[0][3]) > 0 and float(prefill[0][4]) > 0
    assert "skipped llama.cpp: `import llama_cpp.server` failed" in run.stdout
    assert "skipped vLLM: no `vllm` executable" in run.stdout
