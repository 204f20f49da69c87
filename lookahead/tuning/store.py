"""Where cost models live between processes: one JSON file per key under the user's cache folder
(`lookahead.paths.cache_root()`/costs: $LOOKAHEAD_CACHE_DIR, $XDG_CACHE_HOME/lookahead or ~/.cache/lookahead), and the
parts of a key that say which machine and which software measured it. Shared by the native model
(`lookahead.models.tuning`) and the transformers plug-in (`lookahead.hf.tuning`), whose keys differ in what describes
the model.

The files are an optimisation. A folder that cannot be read or written (read-only, a file where the folder should
be, no home folder) leaves the cost model in memory for the process: it is measured once per process, a warning says
so once, and no generation fails or loses its result for it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
import warnings
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path

from lookahead.paths import ENV_CACHE_DIR, cache_root

from .cost import CostModel

SAVE_EVERY = 60.0  # seconds between writes of the curves the steps keep current


def cache_dir() -> Path | None:
    """The cost models' folder: `cache_root()`/costs (None without a home folder)."""
    root = cache_root()
    return None if root is None else root / "costs"


def cost_path(key: Mapping) -> Path | None:
    """The cache file of a key: its name is a digest of the key (None where there is no cache folder)."""
    folder = cache_dir()
    if folder is None:
        return None
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()
    return folder / f"{digest}.json"


def load_or_new(key: Mapping) -> CostModel:
    """The cost model cached for `key`, or an empty one (with that key) when there is none, it is not trusted or the
    folder cannot be read."""
    path = cost_path(key)
    return (CostModel.load(path, key) if path is not None else None) or CostModel(key=dict(key))


_WARNED: set[str] = set()  # the folders a warning was given for: one each per process


def _cannot_keep(where: str, why: str) -> None:
    if where in _WARNED:
        return
    _WARNED.add(where)
    warnings.warn(f"cannot keep the measured step costs in {where} ({why}); they are kept in memory for "
                  f"this process only (set {ENV_CACHE_DIR} to a writable folder to keep them)", RuntimeWarning,
                  stacklevel=3)


class Saver:
    """Writes a measured cost model back to its cache file, at once (`now`) or at most every `SAVE_EVERY` seconds
    (`if_due`): the next process starts from the curves as this one's steps left them. A cost model with an empty
    key (set by the user) is never written."""

    def __init__(self) -> None:
        self.saved = 0.0  # when it last wrote (time.monotonic)

    def now(self, cost: CostModel) -> None:
        """Write `cost` to its file now; where that fails, say so once per folder and go on (the curves stay in
        memory; the next write is tried `SAVE_EVERY` seconds later)."""
        if not cost.key:
            return
        self.saved = time.monotonic()
        path = cost_path(cost.key)
        if path is None:
            _cannot_keep("a cache folder", "there is no home folder")
            return
        try:
            cost.save(path)
        except OSError as error:
            _cannot_keep(str(path.parent), error.strerror or type(error).__name__)

    def if_due(self, cost: CostModel | None) -> None:
        if cost is not None and time.monotonic() - self.saved >= SAVE_EVERY:
            self.now(cost)


def device_label(device) -> str:
    """"cuda:<GPU name>" or "cpu:<processor name>" for a torch device."""
    if device.type == "cuda":
        import torch

        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_processor_name()}"


def versions(*packages: str) -> list[str]:
    """The installed versions of `packages` ("none" for one that is not installed)."""
    return [_version(package) for package in packages]


@cache  # constant for the process: keys are built before every self-tuned generation
def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"
