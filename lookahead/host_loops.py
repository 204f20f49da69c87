"""The engine's host loops compiled (issue 36): what runs for every draft node, step row or slot of every lookahead row
every step, in C++ through the Python C API over the package's own lists and dicts (read and written in place):

    grow           `DraftBuilder._grow`: the best-first growth over the proposals and the recycled tables
    learn          `RecycleTables.update_step`: a step's top-k into the recycled tables
    continuations  `SuffixIndex.continuations`: earlier occurrences of the sequence's suffix and what followed
    extend         `SuffixIndex.extend`: the m-grams of the accepted tokens into the suffix index
    grown          `DraftTree.grown`: a best-first draft renumbered in pre-order
    slots          `StepBudget._slots`: every row's calibrated node worths, merged in the order the budget takes them

Each does exactly what the Python code beside its caller does (`..._python`, kept for where the build fails), node
for node and bit for bit: the same float operations in the same order (no fused multiply-adds), the same heap
order and stable sorts, the same entries in the same order, one list object per step row where Python shares one.
So the drafts, the steps' sizes and the acceptance are the same either way; tests/test_host_paths.py holds each to
its Python path and to the older reference.

The source (`csrc/host_loops.cpp`) is compiled at first use by `lookahead.cpp_build` into the cache folder's `kernels`
(torch's default build folder without one), one build per architecture, Python version, compiler and version of the
source (as `lookahead.kernels.cpu_kernels`'s is, per kind of CPU); where that fails `load` returns None (with one
warning) and every caller runs its Python path. It imports nothing of the package but `lookahead.paths` and
`lookahead.cpp_build`: the drafts and the tuning room both use it.
"""

from __future__ import annotations

import platform
from pathlib import Path

import lookahead.cpp_build as cpp_build
from lookahead.paths import cache_root

# plain -O2, no -march=native: one build serves every CPU of an architecture; no fused multiply-adds: the products
# must round as Python's do
EXTENSION = cpp_build.Extension("lookahead_host_loops", (Path(__file__).parent / "csrc" / "host_loops.cpp",),
                                cflags=("-O2", "-ffp-contract=off", "-Wall", "-Wextra"), target=platform.machine(),
                                what="the engine's host loops")

_built = cpp_build.Once("The engine runs their Python code instead (the same drafts and steps, slower)")


def load():
    """The compiled module (building it on the first call), or None where it cannot be built (one warning)."""
    return _built.get(lambda: EXTENSION, _folder)


def _folder() -> Path:
    root = cache_root()
    if root is not None:
        return root / "kernels"
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())
