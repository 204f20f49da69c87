"""Where lookahead keeps files between processes: the one rule for its cache folder.

`cache_root()` is `$LOOKAHEAD_CACHE_DIR` if set, else `$XDG_CACHE_HOME/lookahead` (an absolute XDG_CACHE_HOME, as the
XDG spec asks), else `~/.cache/lookahead`; None where there is no home folder to put it in. The converted default
model lives in it, the measured cost models under `costs/`, and the batch-invariant mode's CPU kernel, compiled once
per machine, under `kernels/`. What is kept there is an optimisation: a folder that
cannot be written costs a measurement or a conversion per process, never a generation (`lookahead.tuning.store`).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "LOOKAHEAD_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache folder: $LOOKAHEAD_CACHE_DIR, $XDG_CACHE_HOME/lookahead or ~/.cache/lookahead (None without a home)."""
    explicit = os.environ.get(ENV_CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "lookahead"
    try:
        return Path.home() / ".cache" / "lookahead"
    except RuntimeError:  # no HOME and no passwd entry
        return None
