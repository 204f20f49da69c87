"""The one build of the package's C++ extensions (the CPU kernels of `lookahead.kernels.cpu_kernels`, the host loops of
`lookahead.host_loops`): their cache key, lock, progress, validation and loading.

A build is keyed by what it is made of: the sources' text (and the files they include), the flags, the compiler
(`$CXX`, else `c++`, as torch's loader picks it, and its `--version`), the target (a kind of CPU for `-march=native`),
torch's and Python's versions. Its library is `<name>.so` in the build folder, beside a manifest `<name>.json` (its
size and sha256) written after a successful link. A library that matches its manifest is imported directly: no build
tool runs, so which ninja last touched the folder never matters. A missing or damaged one (cut short, overwritten) is
built again, said once on stderr.

A build runs in a child process (torch's loader with ninja, in a staging folder of its own) that leads a process group:
the whole group is killed if the caller raises (Ctrl-C), and the child kills it when the caller dies (the parent-death
signal on Linux), so no compiler outlives the process that wanted it. One lock covers a build, across threads and
processes (`flock`, which the kernel drops with a killed holder: no stale lock can block a later build). Any wait over
`FIRST_TICK_S` prints the elapsed time every `TICK_S`.

Imports nothing of the package and no torch until a build is loaded: the kernels and the host loops both use it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # not a POSIX system: the thread lock alone
    fcntl = None

HELPER_VERSION = "1"  # part of every key: a change to how builds are made makes new ones
FIRST_TICK_S = 5.0  # a wait this long prints its elapsed time ...
TICK_S = 10.0  # ... and again this often


class BuildError(RuntimeError):
    """An extension could not be built; the message is its cause in one line."""


@dataclass(frozen=True)
class Extension:
    """What an extension is made of. sources: compiled (one translation unit each, in order); includes: files they
    include (their text is part of the key); target: what the flags build for beyond themselves (a kind of CPU);
    what: its name in messages."""

    prefix: str
    sources: tuple[Path, ...]
    includes: tuple[Path, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    target: str = ""
    what: str = "a C++ extension"


_thread_lock = threading.Lock()


class Once:
    """An extension loaded at most once per process: `get` gives its module, or None where it cannot be built, after
    one warning naming the cause (`failure`) and what runs `instead`."""

    def __init__(self, instead: str) -> None:
        self.instead = instead
        self.module: ModuleType | None = None
        self.failure: str | None = None
        self._lock = threading.Lock()

    def get(self, extension: Callable[[], Extension], folder: Callable[[], str | os.PathLike]) -> ModuleType | None:
        """The module, building `extension()` into `folder()` on the first call (both asked for only then)."""
        if self.module is None and self.failure is None:
            with self._lock:
                if self.module is None and self.failure is None:
                    self._load(extension(), folder)
        return self.module

    def _load(self, ext: Extension, folder: Callable[[], str | os.PathLike]) -> None:
        try:
            self.module = load(ext, folder())
        except (BuildError, OSError) as e:  # no compiler, a read-only folder: the caller's slower path instead
            self.failure = str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
            warnings.warn(f"lookahead: {ext.what} were not built: {self.failure}. {self.instead}", stacklevel=5)


def compiler() -> tuple[str, str]:
    """(the C++ compiler torch's loader would run, its `--version` output); BuildError naming it where it is missing."""
    command = os.environ.get("CXX", "").strip() or "c++"
    return command, _version(command)


@functools.cache
def _version(command: str) -> str:
    if shutil.which(command) is None:
        raise BuildError(f"no C++ compiler found ({command}: not found)")
    try:
        run = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"no working C++ compiler ({command} --version: {e})") from e
    if run.returncode != 0:
        raise BuildError(f"no working C++ compiler ({command} --version exited with {run.returncode})")
    return run.stdout.strip()


def build_name(ext: Extension) -> str:
    """The build's name (its module's and library's): the prefix and a hash of everything the build is made of."""
    import torch

    key = hashlib.sha256()
    for part in (HELPER_VERSION, ext.target, *ext.cflags, "|", *ext.ldflags, "|", *compiler(), torch.__version__,
                 str(torch.version.git_version), sys.implementation.cache_tag, platform.machine()):
        key.update(part.encode() + b"\0")
    for path in (*ext.sources, *ext.includes):
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{ext.prefix}_{key.hexdigest()[:16]}"


def load(ext: Extension, folder: str | os.PathLike) -> ModuleType:
    """The extension's module from `folder` (created if missing), built there first where no valid build is:
    BuildError with the cause in one line where it cannot be."""
    folder = Path(folder)
    name = build_name(ext)
    library = folder / f"{name}.so"
    with _thread_lock:
        if not _valid(library):
            folder.mkdir(parents=True, exist_ok=True)
            with _file_lock(folder / f"{name}.lock", ext.what):
                if not _valid(library):  # (another process may have built it meanwhile)
                    if library.exists():
                        _say(f"{library} does not match its manifest (cut short or overwritten); building it again")
                    _build(ext, name, folder)
        return _import(name, library)


def _valid(library: Path) -> bool:
    """Whether the library is the one its manifest describes (a library cut short would crash the process)."""
    try:
        manifest = json.loads(library.with_suffix(".json").read_text())
        if library.stat().st_size != manifest["size"]:
            return False
        return _sha256(library) == manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _import(name: str, library: Path) -> ModuleType:
    import torch  # noqa: F401  (the library links against torch's: load it first)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise BuildError(f"{library} does not load: {e}") from e
    return module


class _file_lock:
    """The build's lock across processes, waited for with a ticking elapsed time."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what, self.file = path, what, None

    def __enter__(self) -> None:
        if fcntl is None:
            return
        self.file = open(self.path, "a")
        if not self._take():
            _wait(self._take, f"waiting for another process compiling {self.what}")

    def _take(self) -> bool:
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # (closing drops the lock)


def _wait(done: Callable[[], bool], doing: str) -> None:
    """Poll `done` until it is true, printing the elapsed time from FIRST_TICK_S on, every TICK_S."""
    start, tick = time.monotonic(), FIRST_TICK_S
    while not done():
        elapsed = time.monotonic() - start
        if elapsed >= tick:
            _say(f"{doing} ... {elapsed:.0f} s")
            tick += TICK_S
        time.sleep(0.1)


def _say(message: str) -> None:
    print(f"lookahead: {message}", file=sys.stderr, flush=True)


# The child that builds: torch's loader in a fresh staging folder (no ninja log of another ninja to reject), in a
# process group it leads. On SIGTERM (sent by the parent on an exception, or by the kernel as the parent-death signal
# when the parent dies: Linux) it ends the build: ninja runs each compiler in a process group of its own and passes a
# SIGTERM on to them, so the group gets SIGTERM first, then SIGKILL for what is left.
_CHILD = """
import ctypes, json, os, signal, sys, time
args = json.loads(sys.argv[1])
def end(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    time.sleep(2)
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != args["parent"]:  # the parent died before the signal was set
    end()
from torch.utils.cpp_extension import load
load(args["name"], args["sources"], extra_cflags=args["cflags"], extra_ldflags=args["ldflags"],
     build_directory=args["staging"], verbose=True)
"""


def _build(ext: Extension, name: str, folder: Path) -> None:
    """Compile into a staging folder, then put the library in place and write its manifest (in that order)."""
    staging = folder / f"{name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    log = folder / f"{name}.log"  # the compiler's output, warnings included
    try:
        _compile(ext, name, staging, log)
        built = staging / f"{name}.so"
        manifest = {"size": built.stat().st_size, "sha256": _sha256(built)}
        os.replace(built, folder / f"{name}.so")
        partial = staging / "manifest.json"
        partial.write_text(json.dumps(manifest))
        os.replace(partial, folder / f"{name}.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _compile(ext: Extension, name: str, staging: Path, log: Path) -> None:
    args = {"parent": os.getpid(), "name": name, "sources": [str(s) for s in ext.sources], "cflags": list(ext.cflags),
            "ldflags": list(ext.ldflags), "staging": str(staging)}
    env = dict(os.environ)
    # the ninja beside this Python (a venv's, run without activating it) before any other: ninja must be found
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    _say(f"compiling {ext.what} for this machine into {staging.parent} (once)")
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args)], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            _wait(lambda: child.poll() is not None, f"still compiling {ext.what}")
        except BaseException:  # Ctrl-C, a SystemExit: the compilers go with the caller
            _end(child)
            raise
    if child.returncode != 0:
        raise BuildError(f"compiling {ext.what} failed: {_first_error(log)} (the whole output: {log})")


def _end(child: subprocess.Popen) -> None:
    """End a build: the child ends its ninja and compilers (SIGTERM), then its group is killed should any be left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:  # the group is gone: everything in it has ended
            break
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    child.wait()


def _first_error(log: Path) -> str:
    """The compiler's first error line in the build's output, or its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith(("[", "FAILED"))]
    return (errors or lines or ["no output"])[0][:300]
