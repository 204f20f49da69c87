"""Every ```python block of README.md runs as written, in a fresh interpreter, after the Quickstart.

A block may be preceded by an explicit marker, `<!-- readme-test: ... -->`:
- `env NAME=VALUE without CUDA`: set that variable when no GPU is here (the kernel on CPU needs Triton's
  interpreter);
- `skip: reason`: not run, reported as skipped with the reason (none is, today).
Blocks without a marker run as they are. The default model comes from the session's converted copy,
reached through `~/.cache/lookahead` under a temporary HOME, as a user's second run would find it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
BLOCKS = [(m["marker"], m["code"]) for m in BLOCK.finditer(README.read_text(encoding="utf-8"))]


def test_readme_has_python_blocks_and_the_first_uses_the_default_model():
    assert len(BLOCKS) >= 2
    marker, code = BLOCKS[0]
    assert marker is None and "default_model_dir()" in code and "print(" in code


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i + 1}")
def test_readme_python_block_runs_as_written(index, default_model_dir, tmp_path):
    marker, code = BLOCKS[index]
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "lookahead").symlink_to(default_model_dir.parent, target_is_directory=True)
    env = {**os.environ, "HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("TRITON_INTERPRET", None)  # conftest's; a block gets it only through its marker
    if marker is not None:
        if marker.startswith("skip:"):
            pytest.skip(f"README marks this block: {marker}")
        env_marker = re.fullmatch(r"env (\w+)=(\S+) without CUDA", marker)
        assert env_marker, f"unknown readme-test marker {marker!r}"
        if not torch.cuda.is_available():
            env[env_marker[1]] = env_marker[2]
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
