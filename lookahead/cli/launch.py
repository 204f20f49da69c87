"""How the `lookahead` command tells a torchrun launch from a stray WORLD_SIZE, and what it tidies after one.

torchrun (like any `env://` launcher) sets WORLD_SIZE together with RANK, MASTER_ADDR and MASTER_PORT. A
WORLD_SIZE alone is left over from somewhere else (a shell inside a torchrun or SLURM job): joining a group then
would wait for peers that never come, so it is refused at once, before torch is imported. Nothing here imports torch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

LAUNCH_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what env:// needs beside WORLD_SIZE; torchrun sets them all


def world_size(environ: Mapping[str, str]) -> int:
    """The processes of this launch: 1 without WORLD_SIZE (or WORLD_SIZE=1), torchrun's WORLD_SIZE under torchrun.

    Raises ValueError, naming the variables, for a WORLD_SIZE without RANK, MASTER_ADDR and MASTER_PORT beside it
    or values that are not numbers in range."""
    raw = environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "1":
        return 1
    world = _int(environ, "WORLD_SIZE")
    if world < 1:
        raise ValueError(f"WORLD_SIZE={raw!r} must be >= 1; unset WORLD_SIZE to run one process")
    missing = [name for name in LAUNCH_VARS if not environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"WORLD_SIZE={raw} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not, so this is no torchrun launch (a WORLD_SIZE left over from a torchrun or SLURM job?); "
                         "unset WORLD_SIZE to run one process, or start K processes with "
                         "'torchrun --nproc-per-node K -m lookahead generate ...'")
    rank = _int(environ, "RANK")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world} (ranks 0..{world - 1})")
    _int(environ, "MASTER_PORT")
    if environ.get("LOCAL_RANK", "").strip():
        _int(environ, "LOCAL_RANK")
    return world


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer") from None


def remove_empty_log_dir(environ: Mapping[str, str]) -> None:
    """Remove the `torchelastic_*` folder torchrun made in the temp directory for this run, if it holds no file.

    Without --log-dir, torchrun's agent makes `<tmp>/torchelastic_*/<run id>_*/attempt_<n>/<local rank>/` for each
    worker's error file, which only the `@record` decorator writes (the command does not use it), and never removes it:
    one empty folder per run. Called by local rank 0 of each machine after every rank has finished: a folder that holds
    a file (a log, an error report) or that the user chose with --log-dir is kept."""
    error_file = environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not error_file:
        return
    parents = Path(error_file).parents
    if len(parents) < 5:
        return
    root = parents[3]  # <root>/<run id>_*/attempt_<n>/<local rank>/error.json
    if not root.name.startswith("torchelastic_") or root.parent.resolve() != Path(tempfile.gettempdir()).resolve():
        return
    tree = list(os.walk(root))  # top-down: a folder before its subfolders
    if any(files for _, _, files in tree):
        return
    for folder, _, _ in reversed(tree):
        try:
            os.rmdir(folder)
        except OSError:  # no longer empty (something wrote meanwhile) or not ours to remove: keep it
            return
