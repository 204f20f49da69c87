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

The source (`csrc/host_loops.cpp`) is compiled at first use by torch's C++ extension loader (a C++ compiler and
ninja) into the cache folder's `kernels` (torch's default build folder without one), one build per architecture,
Python version and version of the source (as `lookahead.kernels.cpu_gemm`'s is, per kind of CPU); where that fails
`load` returns None (with one warning) and every caller runs its Python path. It imports nothing of the package but
`lookahead.paths`: the drafts and the tuning room both use it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

from lookahead.paths import cache_root

_SOURCE = (Path(__file__).parent / "csrc" / "host_loops.cpp").read_text(encoding="utf-8")

STALE_LOCK_S = 600  # a build holds torch's lock file for seconds; one this old was left by a killed process

_lock = threading.Lock()
_module = None
_failed: str | None = None


def _drop_stale_lock(folder: Path) -> None:
    """torch's loader waits for its build folder's `lock` file forever: a process killed mid-build leaves one behind,
    and every later load would hang (as `lookahead.kernels.cpu_gemm` guards its own build: the tuning room, which
    uses this module, may not import the kernels)."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:  # none there, or gone meanwhile
        pass


def load():
    """The compiled module (building it on the first call), or None where it cannot be built (one warning)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import get_default_build_root
                from torch.utils.cpp_extension import load as load_extension

                source = hashlib.sha256(_SOURCE.encode()).hexdigest()[:8]
                # (plain -O2, no -march=native: one build serves every CPU of an architecture; a CPython extension:
                # one per Python version)
                python = f"py{sys.version_info.major}{sys.version_info.minor}"
                name = f"lookahead_host_{platform.machine()}_{python}_{source}"
                root = cache_root()
                folder = (Path(get_default_build_root()) if root is None else root / "kernels") / name
                folder.mkdir(parents=True, exist_ok=True)
                _drop_stale_lock(folder)
                path = folder / "host.cpp"
                if not path.is_file() or path.read_text() != _SOURCE:  # (a whole file: another process may build)
                    staged = folder / f"host.cpp.{os.getpid()}"
                    staged.write_text(_SOURCE)
                    os.replace(staged, path)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    # (no fused multiply-adds: the products must round as Python's do)
                    _module = load_extension(name, [str(path)], extra_cflags=["-O2", "-ffp-contract=off"],
                                             build_directory=str(folder), verbose=False)
            except Exception as e:  # no compiler, no ninja, a read-only folder: the Python paths instead
                _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(f"lookahead: the compiled host loops could not be built ({_failed}); the engine runs "
                              "their Python code instead (the same drafts and steps, slower)", stacklevel=3)
    return _module
