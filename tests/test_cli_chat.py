"""`lookahead chat`: a conversation through standard input (one message a line) and through a terminal; the
conversation's cache is reused between turns, /reset starts over, end of input and Ctrl-C end it cleanly."""

import contextlib
import io
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from lookahead.cli.chat import _lines

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
TURN = re.compile(r"\] (\d+) tokens, .*; prompt (\d+) tokens, (\d+) of them from the cache")


def test_messages_are_the_non_blank_lines_until_the_input_ends():
    assert list(_lines(io.StringIO("hello\n\n  \n/reset\nbye"), interactive=False)) == ["hello", "/reset", "bye"]


@pytest.mark.slow
def test_chat_through_standard_input(default_model_dir):
    lines = "Name a color.\nAnd another one?\n/reset\nName a color.\n"
    run = subprocess.run([sys.executable, "-m", "lookahead", "chat", "--cache-dir", str(default_model_dir.parent),
                          "--max-new-tokens", "12"], input=lines, capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr
    turns = [tuple(map(int, m.groups())) for m in TURN.finditer(run.stderr)]
    assert len(turns) == 3 and "lookahead: a new conversation" in run.stderr
    (answer1, prompt1, _), (_, prompt2, cached2), (_, prompt3, _) = turns
    assert prompt2 > prompt1 + answer1  # the second turn's prompt holds the first turn
    assert cached2 >= (prompt1 + answer1 - 1) // 16 * 16 > 0  # ... and prefilled only what it added (whole blocks)
    assert prompt3 == prompt1  # after /reset: the first message again, alone
    assert run.stdout.count("\n") >= 3 and "Traceback" not in run.stderr


def _read_until_prompts(master: int, seen: bytearray, prompts: int, seconds: float = 300) -> None:
    """Read the terminal's output into `seen` until it has shown `prompts` prompts ("> ")."""
    deadline = time.monotonic() + seconds
    while seen.count(b"> ") < prompts:
        assert time.monotonic() < deadline, bytes(seen)
        if select.select([master], [], [], 0.5)[0]:
            seen += os.read(master, 4096)


def _terminal_signals() -> None:
    """SIGINT as a terminal's foreground process has it. A command a non-interactive shell ran in the background (a
    CI script's `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("end", [b"\x04", signal.SIGINT], ids=["ctrl-d", "ctrl-c"])
def test_chat_on_a_terminal_prompts_and_ends_cleanly(default_model_dir, end):
    """Ctrl-D is the end of input, Ctrl-C a SIGINT (what the terminal sends its foreground process): either ends the
    chat with status 0. (The prompt goes where Python's input() puts it: stderr, which is the terminal here too.)"""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lookahead", "chat", "--cache-dir", str(default_model_dir.parent),
                             "--max-new-tokens", "8"], stdin=slave, stdout=slave, stderr=slave, env=ENV,
                            preexec_fn=_terminal_signals)
    os.close(slave)
    seen = bytearray()
    try:
        _read_until_prompts(master, seen, 1)
        os.write(master, b"Name a color.\n")
        _read_until_prompts(master, seen, 2)  # the answer, then the next prompt
        if isinstance(end, bytes):
            os.write(master, end)
            assert proc.wait(60) == 0
        else:
            # Python's readline checks for signals only when its wait for input is interrupted: a SIGINT that lands
            # between the prompt and that wait is seen at the next one, as a user who presses Ctrl-C again sees
            for _ in range(6):
                proc.send_signal(end)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                    break
            with contextlib.suppress(OSError):  # what the terminal showed meanwhile, for the message below
                while select.select([master], [], [], 0.5)[0]:
                    seen += os.read(master, 4096)
            assert proc.poll() == 0, (proc.poll(), bytes(seen))
    finally:
        proc.kill()
        os.close(master)
    text = seen.decode(errors="replace")
    assert "type a message" in text and "tok/s" in text and "Traceback" not in text, text
