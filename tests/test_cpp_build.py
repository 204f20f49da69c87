"""The one build of the C++ extensions (`lookahead.cpp_build`), on a tiny extension built in each test's own folder:
a valid build loads with no build tool, a damaged one (cut short, or overwritten at its size) is built again, a wait
ticks, a killed caller takes its compiler with it, a missing compiler is named in one line, the key follows the
included files' text, and two processes wanting one build compile it once (issue 49 items 4, 7, 9; issue 50 items 1,
4)."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import lookahead.cpp_build as cpp_build

TINY = Path(__file__).parent / "csrc" / "tiny_extension.cpp"
WHAT = "a test extension"
LOAD = f"""
from pathlib import Path
import lookahead.cpp_build as cpp_build
ext = cpp_build.Extension("tiny", (Path({str(TINY)!r}),), what={WHAT!r})
print(cpp_build.load(ext, {{folder!r}}).answer())
"""


def _start(folder: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD.format(folder=str(folder))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _load(folder: Path, env: dict | None = None) -> tuple[int, str, str]:
    child = _start(folder, env)
    out, err = child.communicate(timeout=300)
    return child.returncode, out, err


def _library(folder: Path) -> Path:
    (library,) = folder.glob("tiny_*.so")
    return library


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A folder holding a fresh build of the tiny extension (copy it before changing it)."""
    folder = tmp_path_factory.mktemp("built")
    rc, out, err = _load(folder)
    assert rc == 0 and out.strip() == "42", err
    assert "compiling a test extension" in err
    return folder


def test_a_valid_build_loads_with_no_build_tool(built, tmp_path):
    """A build keyed by what it is made of is imported directly: a ninja that fails (another ninja than the one that
    wrote the folder's log once made every switch recompile) is never run, nor is anything compiled."""
    tools = tmp_path / "bin"
    tools.mkdir()
    ninja = tools / "ninja"
    ninja.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ninja-ran'}\nexit 1\n")
    ninja.chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    before = _library(built).stat().st_mtime_ns
    rc, out, err = _load(built, env)
    assert rc == 0 and out.strip() == "42", err
    assert "compiling" not in err and not (tmp_path / "ninja-ran").exists()
    assert _library(built).stat().st_mtime_ns == before


def test_a_library_cut_short_is_built_again_and_said_once(built, tmp_path):
    """A library truncated in place (it crashed every process with a bus error) does not match its manifest: it is
    built again, said once, and the new one loads."""
    folder = tmp_path / "cache"
    shutil.copytree(built, folder)
    library = _library(folder)
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    rc, out, err = _load(folder)
    assert rc == 0 and out.strip() == "42", err
    assert err.count("does not match its manifest") == 1, err
    assert cpp_build._valid(library)


def test_a_wait_for_another_build_ticks_and_a_killed_holder_frees_the_lock(built, tmp_path):
    """A build another process holds is waited for with the elapsed time on stderr; a holder killed mid-build (whose
    lock file stays) blocks nobody: the kernel drops its lock."""
    folder = tmp_path / "cache"
    shutil.copytree(built, folder)
    library = _library(folder)
    library.unlink()
    hold = f"import fcntl, time; f = open({str(library.with_suffix('.lock'))!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)" \
           "; print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    loader = _start(folder)
    guard = threading.Timer(300, holder.kill)  # (should the loader never wait, it would never end)
    guard.start()
    said = []
    for line in loader.stderr:  # until the loader says it waits, or builds at once
        said.append(line)
        if "waiting" in line or "compiling" in line:
            break
    holder.kill()
    holder.wait()
    guard.cancel()
    out, rest = loader.communicate(timeout=300)
    err = "".join(said) + rest
    assert loader.returncode == 0 and out.strip() == "42", err
    assert f"waiting for another process compiling {WHAT} ... 5 s" in err, err


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_caller_killed_mid_build_takes_its_compiler_with_it(tmp_path, how):
    """Killing the process that builds (SIGTERM: no Python cleanup runs; SIGINT: KeyboardInterrupt) ends its compiler;
    meanwhile the compile's elapsed time ticks."""
    real = shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler")
    pid_file = tmp_path / "compiler.pid"
    wrapper = tmp_path / "bin" / "c++"  # compiles nothing: sleeps where it would compile a source
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-c" ] && echo $$ > {pid_file} && exec sleep 300; done\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    caller = _start(tmp_path / "cache", {**os.environ, "CXX": str(wrapper)})
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    compiler = int(pid_file.read_text())
    time.sleep(cpp_build.FIRST_TICK_S + 1)
    caller.send_signal(how)
    _, err = caller.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(compiler) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(compiler), "the compiler outlived its caller"
    assert f"still compiling {WHAT} ... 5 s" in err, err


NO_COMPILER = """
import warnings
warnings.simplefilter("always")
import torch
from lookahead.kernels import cpu_kernels
from lookahead.models import placement
print(cpu_kernels.available({folder!r}))
placement.bf16_dot_products = lambda: "avx512_bf16"  # the CPU where the default dtype depends on the kernels
print(placement.default_dtype(torch.device("cpu"), True))
"""


@pytest.mark.parametrize("setting", ["missing CXX", "no compiler on PATH"])
def test_no_compiler_is_named_with_what_it_changes(tmp_path, setting):
    """Without a compiler the warning names the cause ("no C++ compiler found (c++: not found)", not a ninja command
    line) and what changes (the mode's speed, the default dtype), and the dtype's reason says why."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "LOOKAHEAD_DTYPE")}
    if setting == "missing CXX":
        env["CXX"] = command = str(tmp_path / "missing" / "c++")
    else:
        env["PATH"], command = str(tmp_path), "c++"
    run = subprocess.run([sys.executable, "-c", NO_COMPILER.format(folder=str(tmp_path / "cache"))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    cause = f"no C++ compiler found ({command}: not found)"
    available, dtype = run.stdout.splitlines()
    assert available == "False" and "torch.float32" in dtype and cause in dtype
    assert cause in run.stderr and "float32" in run.stderr and "slower" in run.stderr
    assert "ninja" not in run.stderr.lower()


def test_the_key_changes_with_an_included_files_text(tmp_path):
    """A build is keyed by the text of the files its sources include as well as by the sources': a header edited
    (the CPU kernels' module includes both of its sources) makes another build name, so the old library is never
    loaded for the new code; the same text gives the same name."""
    header = tmp_path / "tiny.h"
    header.write_text("#define ANSWER 42\n")
    ext = cpp_build.Extension("tiny", (TINY,), (header,), what=WHAT)
    before = cpp_build.build_name(ext)
    assert cpp_build.build_name(ext) == before
    header.write_text("#define ANSWER 43\n")
    assert cpp_build.build_name(ext) != before
    header.write_text("#define ANSWER 42\n")
    assert cpp_build.build_name(ext) == before


def test_a_library_overwritten_at_its_size_is_built_again(built, tmp_path):
    """A library whose bytes changed but not its size (overwritten in place) does not match its manifest's sha256:
    it is built again, said once, and the new one loads."""
    folder = tmp_path / "cache"
    shutil.copytree(built, folder)
    library = _library(folder)
    data = library.read_bytes()
    middle = len(data) // 2
    library.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    assert library.stat().st_size == len(data)
    rc, out, err = _load(folder)
    assert rc == 0 and out.strip() == "42", err
    assert err.count("does not match its manifest") == 1, err
    assert cpp_build._valid(library)


def test_two_processes_wanting_the_same_build_compile_it_once(tmp_path):
    """Two processes that want the same missing build at the same moment: one compiles, the other waits for its
    lock, finds the library valid and loads it; the compiler runs once."""
    folder = tmp_path / "cache"
    loaders = [_start(folder), _start(folder)]
    said = [loader.communicate(timeout=300) for loader in loaders]
    assert [loader.returncode for loader in loaders] == [0, 0], said
    assert [out.strip() for out, _ in said] == ["42", "42"], said
    assert sum(err.count(f"compiling {WHAT} for this machine") for _, err in said) == 1, said
