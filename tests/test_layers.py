"""The house's layers: imports point one way (kernels <- loop <- models <- CLI), with no circle between modules,
type-only imports included, and every room imports only the rooms below it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from lookahead.folders import FOLDERS as FOLDER_NAMES

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {package: ROOT / folder for package, folder in FOLDER_NAMES.items()}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports, at module level, in functions and under TYPE_CHECKING alike."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in MODULES:  # `from pkg import name`: the module itself or the package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_circle():
    """A depth-first search over the import graph finds no cycle (a package's __init__ counts as a module)."""
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = trail[trail.index(target):] + [target] if target in trail else [module, target]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


# each room and what it may not import (directly or not)
RULES = {
    "lookahead.kernels": ("lookahead.",),  # but itself and the build helper (ALLOWED)
    "lookahead.cpp_build": ("lookahead.",),  # the one build of the C++ extensions: a leaf below the kernels
    "lookahead.config": ("lookahead.",),
    # all but lookahead.paths (where its build goes) and lookahead.cpp_build (how)
    "lookahead.host_loops": ("lookahead.kernels", "lookahead.config", "lookahead.backends", "lookahead.request",
                         "lookahead.tuning", "lookahead.drafts", "lookahead.loop", "lookahead.parallel", "lookahead.hf",
                         "lookahead.cli", "lookahead.models", "lookahead.serve", "lookahead.structured"),
    "lookahead.paths": ("lookahead.",),
    "lookahead.backends": ("lookahead.",),
    "lookahead.request": ("lookahead.loop", "lookahead.drafts", "lookahead.parallel", "lookahead.hf", "lookahead.cli",
                          "lookahead.models", "lookahead.serve"),
    "lookahead.tuning": ("lookahead.loop", "lookahead.drafts", "lookahead.request", "lookahead.parallel",
                         "lookahead.hf", "lookahead.cli", "lookahead.models", "lookahead.kernels", "lookahead.serve"),
    "lookahead.drafts": ("lookahead.loop", "lookahead.parallel", "lookahead.hf", "lookahead.cli", "lookahead.models",
                         "lookahead.serve"),
    "lookahead.loop": ("lookahead.parallel", "lookahead.hf", "lookahead.cli", "lookahead.models", "lookahead.serve"),
    "lookahead.parallel": ("lookahead.hf", "lookahead.cli", "lookahead.models", "lookahead.serve"),
    "lookahead.hf": ("lookahead.parallel", "lookahead.cli", "lookahead.models", "lookahead.serve"),
    "lookahead.models": ("lookahead.hf", "lookahead.cli", "lookahead.serve"),
    "lookahead.serve": ("lookahead.hf", "lookahead.cli"),  # the HTTP layer: over models, loop, request, config
}
# what a room may import although its rule names it: the kernels' C++ is built by the helper the host loops use too
ALLOWED = {"lookahead.kernels": ("lookahead.cpp_build",)}


def _reach(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("room", sorted(RULES))
def test_rooms_import_only_rooms_below(room):
    members = [m for m in MODULES if m == room or m.startswith(room + ".")]
    assert members, room
    for module in members:
        bad = [t for t in _reach(module) if t.startswith(RULES[room]) and not (t == room or t.startswith(room + "."))
               and t not in ALLOWED.get(room, ())]
        assert not bad, f"{module} reaches {sorted(bad)}"


LOADED = """
import sys, importlib
importlib.import_module({module!r})
print(' '.join(sorted(m for m in sys.modules if m.startswith(('lookahead', 'torch')))))
"""


@pytest.mark.parametrize("module, forbidden", [
    ("lookahead.kernels", ("lookahead.loop", "lookahead.models", "lookahead.drafts", "lookahead.request")),
    ("lookahead.loop", ("lookahead.models", "lookahead.cli", "lookahead.parallel", "lookahead.hf")),
    ("lookahead", ("lookahead.loop", "lookahead.models", "torch")),
    ("lookahead.cli", ("lookahead.loop", "lookahead.models", "lookahead.serve", "torch")),  # --help answers at once
])
def test_a_fresh_interpreter_loads_nothing_above_the_layer(module, forbidden):
    out = subprocess.run([sys.executable, "-c", LOADED.format(module=module)], capture_output=True, text=True,
                         check=True).stdout.split()
    packages = tuple(f for f in forbidden if f != "torch")
    assert not [m for m in out if m.startswith(packages)], out
    assert "torch" not in forbidden or "torch" not in out, out


SHADOW = """
import importlib.abc, importlib.util, sys
class Elsewhere(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lookahead.kernels":
            return importlib.util.spec_from_file_location(name, {other!r}, submodule_search_locations=[])
sys.meta_path.insert(0, Elsewhere())
import lookahead
"""


def test_a_kernels_package_from_another_checkout_fails_loudly(tmp_path):
    """An editable install of another checkout that maps lookahead.kernels elsewhere must not mix silently."""
    other = tmp_path / "other-checkout" / "kernels" / "__init__.py"
    other.parent.mkdir(parents=True)
    other.write_text("")
    run = subprocess.run([sys.executable, "-c", SHADOW.format(other=str(other))], capture_output=True, text=True)
    assert run.returncode != 0 and "not part of this lookahead" in run.stderr, run.stderr
