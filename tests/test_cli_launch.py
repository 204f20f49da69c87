"""The `lookahead` command and torchrun: a stray WORLD_SIZE is refused at once, a launch whose peers never come gives up
with a clear error and ends on SIGTERM while it waits, and torchrun's empty log folder is removed after a run."""

import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

import lookahead.cli.generate as cli_generate
from lookahead.cli import main
from lookahead.cli.launch import remove_empty_log_dir, world_size

LAUNCH = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN_ONLY = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ONLY}
    return {**env, "OMP_WAIT_POLICY": "PASSIVE", **extra}


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("environ, world", [
    ({}, 1),
    ({"WORLD_SIZE": "1"}, 1),
    ({"WORLD_SIZE": "2", **LAUNCH}, 2),
    ({"WORLD_SIZE": "4", **LAUNCH, "RANK": "3", "LOCAL_RANK": "1"}, 4),
], ids=["none", "one", "torchrun2", "torchrun4-rank3"])
def test_world_size_of_a_launch(environ, world):
    assert world_size(environ) == world


@pytest.mark.parametrize("environ, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not, so this is no torchrun "
                          "launch"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "WORLD_SIZE=2 is set but MASTER_PORT is not"),
    ({"WORLD_SIZE": "two", **LAUNCH}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0", **LAUNCH}, "WORLD_SIZE='0' must be >= 1"),
    ({"WORLD_SIZE": "2", **LAUNCH, "RANK": "2"}, r"RANK=2 is outside WORLD_SIZE=2 \(ranks 0..1\)"),
    ({"WORLD_SIZE": "2", **LAUNCH, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
], ids=["stray", "no-port", "not-a-number", "zero", "rank-outside", "bad-port"])
def test_launch_variables_that_are_refused(environ, message):
    with pytest.raises(ValueError, match=message):
        world_size(environ)


def test_stray_world_size_exits_at_once_naming_it():
    """A shell inside a torchrun or SLURM job (WORLD_SIZE=2, no peer) used to print nothing and block for ever."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "lookahead", "generate", "Hello"], capture_output=True, text=True,
                         env=clean_env(WORLD_SIZE="2"), timeout=60)
    assert (run.returncode, run.stdout) == (2, "")
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("lookahead: error: WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not")
    assert "unset WORLD_SIZE to run one process" in line
    assert time.perf_counter() - start < 30  # refused before torch loads


@pytest.mark.parametrize("rank", ["0", "1"], ids=["host", "client"])
def test_a_launch_whose_peers_never_come_gives_up(capsys, monkeypatch, tmp_path, rank):
    """RANK 0 hosts the rendezvous and waits for the others; RANK 1 cannot reach a host: both end with one line
    naming WORLD_SIZE and the address, after a notice of what they wait for, and nothing is loaded or converted."""
    port = free_port()
    monkeypatch.setattr(cli_generate, "JOIN_TIMEOUT", cli_generate.timedelta(seconds=1))
    monkeypatch.setattr(cli_generate, "JOIN_NOTICE_S", 0.2)
    for name in TORCHRUN_ONLY:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", **LAUNCH, "RANK": rank, "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, value)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    code = main(["generate", "Hello", "--cache-dir", str(tmp_path / "cache")])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert (code, out) == (1, "")
    assert lines[0] == (f"lookahead: waiting for the 2 processes of WORLD_SIZE=2 to meet at 127.0.0.1:{port} "
                        "(torchrun); giving up after 1 s; Ctrl-C ends it")
    assert lines[-1].startswith(f"lookahead: error: WORLD_SIZE=2: the 2 processes did not meet at 127.0.0.1:{port} "
                                "within 1 s (")
    assert lines[-1].endswith("start them with 'torchrun --nproc-per-node 2 -m lookahead generate ...', or unset "
                              "WORLD_SIZE to run one process")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored after
    assert not (tmp_path / "cache").exists()


def test_sigterm_ends_a_launch_waiting_for_its_peers():
    """SIGTERM (and SIGINT, the same way) used to be ignored while init_process_group waited."""
    env = clean_env(WORLD_SIZE="2", **{**LAUNCH, "MASTER_PORT": free_port()})
    process = subprocess.Popen([sys.executable, "-m", "lookahead", "generate", "Hello"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([process.stderr], [], [], 60)
        line = process.stderr.readline() if ready else ""  # the notice: it is waiting, in torch's C++ code
        assert line.startswith("lookahead: waiting for the 2 processes of WORLD_SIZE=2 to meet at 127.0.0.1:"), line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == -signal.SIGTERM
    finally:
        process.kill()
        process.communicate()


def log_tree(root, ranks=2):
    """torchrun's log folder for a run without --log-dir: <tmp>/torchelastic_*/<run id>_*/attempt_0/<local rank>/."""
    for rank in range(ranks):
        (root / "run_x" / "attempt_0" / str(rank)).mkdir(parents=True)
    return {"TORCHELASTIC_ERROR_FILE": str(root / "run_x" / "attempt_0" / "0" / "error.json")}


def test_torchruns_empty_log_folder_is_removed(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    environ = log_tree(tmp_path / "torchelastic_abc")
    remove_empty_log_dir(environ)
    assert list(tmp_path.iterdir()) == []
    remove_empty_log_dir(environ)  # gone already: nothing to do
    remove_empty_log_dir({})  # not under torchrun


def test_log_folders_with_a_file_or_chosen_by_the_user_are_kept(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    environ = log_tree(tmp_path / "torchelastic_abc")
    attempt = tmp_path / "torchelastic_abc" / "run_x" / "attempt_0"
    (attempt / "filtered_stderr.log").write_text("")  # beside the rank folders, which are removed first if at all
    remove_empty_log_dir(environ)
    assert (attempt / "0").is_dir() and (attempt / "1").is_dir()
    for chosen in (tmp_path / "my_logs", tmp_path / "elsewhere" / "torchelastic_abc"):  # --log-dir DIR
        remove_empty_log_dir(log_tree(chosen))
        assert (chosen / "run_x" / "attempt_0" / "0").is_dir()
