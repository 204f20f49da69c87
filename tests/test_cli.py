"""The `lookahead` command: arguments checked before torch loads, one-line errors naming flags, --debug, the run."""

import builtins
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lookahead.cli as lookahead_cli
import lookahead.cli.generate
from lookahead import LookaheadConfig
from lookahead.cli import main

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def command() -> list[str]:
    """The installed console script if there is one beside this Python, else the same entry through -m."""
    script = Path(sys.executable).with_name("lookahead")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "lookahead"]


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def generate_help() -> str:
    return lookahead_cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()


def test_help_lists_every_option():
    text = generate_help()
    for option in ("--model", "--cache-dir", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                   "--raw", "--window", "--ngram", "--guesses", "--no-lookahead", "--fixed-steps", "--compare",
                   "--show-steps", "--dtype", "--device", "--attn-backend", "--fusion", "--debug"):
        assert option in text


def test_defaults_come_from_lookahead_config():
    """The CLI copies no default: -N's default, the help's W and G, and the CLI's DEFAULTS are LookaheadConfig()'s."""
    defaults = LookaheadConfig()
    assert lookahead_cli.DEFAULTS == defaults
    args = lookahead_cli.build_parser().parse_args(["generate", "x"])
    assert (args.window, args.ngram, args.guesses) == (None, defaults.ngram, None)  # None: LookaheadConfig's, scaled
    text = " ".join(generate_help().split())
    assert f"lookahead window W (default: {defaults.window};" in text
    assert f"verified candidates per step G (default: {defaults.guesses};" in text
    assert f"n-gram size N (default: {defaults.ngram})" in text


def test_help_states_each_default_once():
    """ArgumentDefaultsHelpFormatter added "(default: None)" after helps that state their default in words."""
    text = generate_help()
    blocks = re.split(r"\n(?=  -)", text.split("options:")[1].strip("\n"))
    assert len(blocks) == 22  # -h and the 21 options
    for block in blocks:
        assert block.count("(default") <= 1, block
    flat = " ".join(text.split())
    assert "(default: None)" not in flat and "(default: False)" not in flat
    for expected in ("the most tokens to generate (per answer) (default: 256)",
                     "0 is greedy; > 0 samples (default: 0.0)",
                     "(0: off) (default: 0)", "in (0, 1] (default: 1.0)", "(default: a fresh one each run)"):
        assert expected in flat


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"lookahead {importlib.metadata.version('lookahead')}\n"


class PieceTokenizer:
    """decode: the concatenated text pieces of the ids (what the stream printer needs of a tokenizer)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


STEPS = [[0], [1, 2], [3], [4, 5, 6]]  # tokens per step: two multi-token steps
PIECES = ["def rev(s):", "\n    return", " s[", "::-1", "]", "\n", ""]


@pytest.mark.parametrize("encoding, marks", [("utf-8", ("\u27e6", "\u27e7")), ("ascii", ("<|", "|>"))])
def test_show_steps_marks_cannot_be_confused_with_code(monkeypatch, encoding, marks):
    """Square brackets made `s[::-1]` read `s[[::-1]]`; off a terminal the marks are brackets code does not use."""
    stdout = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr(sys, "stdout", stdout)
    printer = lookahead.cli.generate.StreamPrinter(PieceTokenizer(PIECES), show_steps=True, color=False)
    for tokens in STEPS:
        printer(tokens)
    stdout.seek(0)
    left, right = marks
    assert stdout.read() == f"def rev(s):{left}\n    return s[{right}::-1{left}]\n{right}"
    assert marks == lookahead.cli.generate._marks(stdout)


def test_help_and_bad_arguments_never_import_torch_and_set_omp_first():
    """--help and --version answer at once, and OMP_WAIT_POLICY is in place before anything could load torch."""
    probe = """
import os, sys
import lookahead.cli as lookahead_cli
for argv in (["generate", "--help"], ["--version"]):
    try:
        lookahead_cli.main(argv)
    except SystemExit:
        pass
code = lookahead_cli.main(["generate", "x", "--top-p", "2"])
heavy = sorted(m for m in ("torch", "transformers", "lookahead.loop", "lookahead.request", "lookahead.models")
               if m in sys.modules)
print(code, os.environ.get("OMP_WAIT_POLICY"), heavy)
"""
    env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "2 PASSIVE []"
    assert run.stderr.strip().splitlines() == ["lookahead: error: --top-p must be in (0, 1], got 2.0"]


@pytest.mark.parametrize("argv, message", [
    (["-N", "1"], "--ngram/-N must be >= 2, got 1"),
    (["-W", "0"], "--window/-W must be >= 1, got 0"),
    (["-G", "-1"], "--guesses/-G must be >= 0, got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--top-k", "-2"], "--top-k must be >= 0 (0 is off), got -2"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 is greedy), got -1.0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0 is greedy), got inf"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--seed", str(2**64)], f"--seed must be in [0, 2**64), got {2**64}"),
    (["--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--model", ""], "--model is empty; give a checkpoint folder, or leave the flag out for SmolLM2-135M-Instruct"),
    (["--model", "/nonexistent/x"], "--model '/nonexistent/x' is not a folder or a .gguf file (it does not exist)"),
    (["--cache-dir", ""], "--cache-dir is empty; give a folder or leave the flag out"),
])
def test_bad_arguments_get_one_line_naming_the_flag(capsys, argv, message):
    code, out, err = run_main(capsys, "generate", "Hello", *argv)
    assert (code, out, err) == (2, "", [f"lookahead: error: {message}"])


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", "-W", "2.5"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lookahead: error: argument --window/-W: invalid int value: '2.5' (see 'lookahead generate --help')"]


def test_cache_dir_that_is_a_file_and_model_without_tokenizer(capsys, tmp_path, tiny_checkpoint):
    file = tmp_path / "file"
    file.write_text("x")
    assert run_main(capsys, "generate", "Hello", "--cache-dir", str(file)) == (
        2, "", [f"lookahead: error: --cache-dir '{file}' is a file, not a folder"])
    folder = tiny_checkpoint("gqa")  # saved by transformers without a tokenizer
    capsys.readouterr()
    code, _, err = run_main(capsys, "generate", "Hello", "--model", str(folder))
    assert code == 2 and err == [f"lookahead: error: --model '{folder}' has no tokenizer.json or tokenizer.model: "
                                 "the command needs the checkpoint's tokenizer (use the Python API to bring your own)"]


@pytest.mark.parametrize("unreadable", ["folder", "config.json"])
def test_unreadable_model_folder_is_one_line(capsys, monkeypatch, tmp_path, unreadable):
    """Used to end in a PermissionError traceback. As root nothing is unreadable, so there the error that stat or
    open raises for another user is raised by hand."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    target = folder if unreadable == "folder" else folder / unreadable
    denied = PermissionError(13, "Permission denied", str(target))
    if os.geteuid() != 0:
        target.chmod(0)
    elif unreadable == "folder":
        is_file = Path.is_file
        monkeypatch.setattr(Path, "is_file", lambda p: is_file(p) if folder not in p.parents else raise_(denied))
    else:
        monkeypatch.setattr(lookahead_cli, "open", raising=False,
                            value=lambda p, mode: raise_(denied) if Path(p) == target else builtins.open(p, mode))
    try:
        code, out, err = run_main(capsys, "generate", "Hello", "--model", str(folder))
    finally:
        target.chmod(0o755)
    assert (code, out, err) == (2, "", [f"lookahead: error: --model '{folder}' cannot be read (Permission denied): "
                                        "check its permissions"])


def raise_(error):
    raise error


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, "generate", "Hello", "--device", "cuda", "--cache-dir", str(tmp_path))
    assert code == 1 and len(err) == 2  # the loading line, then the error
    assert err[1].startswith("lookahead: error: --device cuda: ") and err[1].endswith("use --device cpu")
    assert list(tmp_path.iterdir()) == []  # refused before any conversion


def test_unexpected_errors_are_one_line_with_a_debug_hint(capsys, monkeypatch):
    def broken(args):
        raise AssertionError("internal\nstate broken")

    monkeypatch.setattr(lookahead.cli.generate, "run", broken)
    code, _, err = run_main(capsys, "generate", "Hello")
    assert code == 1
    assert err == ["lookahead: error: AssertionError: internal state broken (rerun with --debug for the traceback)"]
    with pytest.raises(AssertionError, match="internal"):
        main(["generate", "Hello", "--debug"])


@pytest.mark.slow
def test_cli_end_to_end(default_model_dir):
    cache = default_model_dir.parent
    run = subprocess.run([*command(), "generate", "Name three colors.", "--cache-dir", str(cache),
                          "--max-new-tokens", "20", "--show-steps"], capture_output=True, text=True, env=ENV,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    err = run.stderr.strip().splitlines()
    assert err[0] == "lookahead: loading torch and the default model ..."
    assert err[1].startswith("lookahead: loaded in ") and err[1].endswith("; generating")
    assert "tok/s" in err[-1] and "S=" in err[-1]


@pytest.mark.slow
def test_cli_notes_that_16_bit_may_flip_near_ties(capsys, default_model_dir):
    code, out, err = run_main(capsys, "generate", "Name three colors.", "--cache-dir", str(default_model_dir.parent),
                              "--max-new-tokens", "4", "--dtype", "bfloat16", "--no-batch-invariant")
    assert code == 0 and out.strip()
    assert any(line.startswith("lookahead: note: in bfloat16 the output may differ from plain greedy") for line in err)


@pytest.mark.slow
def test_cli_batch_invariant_is_exact_in_bf16_and_says_no_caveat(capsys, default_model_dir):
    """The batch-invariant mode (a CPU's default): --compare's plain and lookahead answers are the same tokens in
    bfloat16, and the 16-bit caveat is not printed."""
    code, out, err = run_main(capsys, "generate", "Name three colors.", "--cache-dir", str(default_model_dir.parent),
                              "--max-new-tokens", "12", "--dtype", "bfloat16", "--compare")
    assert code == 0 and out.strip()
    assert not any("may differ from plain greedy" in line for line in err)
    assert any("the same tokens" in line for line in err), err


@pytest.mark.slow
def test_cli_converts_a_damaged_cached_model_again(capsys, default_model_dir, tmp_path):
    """Zeroing half of the cached weights used to make `lookahead generate` print an empty line and exit 0."""
    cache = tmp_path / "cache"
    shutil.copytree(default_model_dir, cache / default_model_dir.name)
    weights = cache / default_model_dir.name / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(size - size // 2))
    code, out, err = run_main(capsys, "generate", "Name three colors.", "--cache-dir", str(cache),
                              "--max-new-tokens", "8")
    assert code == 0, err
    assert any("is damaged (model.safetensors does not match the SHA-256 recorded at conversion); converting it "
               "again" in line for line in err)
    assert out.strip()


@pytest.mark.slow
def test_cli_under_torchrun_prints_once_and_matches_one_process(default_model_dir, tmp_path):
    """`torchrun --nproc-per-node 2 -m lookahead generate`: rank 0 alone prints, the defaults scale W and G with
    K (W = K, G = 5K), and the text, tokens and steps are those of one process with W = 2, G = 10; torchrun's empty
    torchelastic_* log folder is not left in the temp directory."""
    cache = default_model_dir.parent
    args = ["generate", "Name three colors.", "--cache-dir", str(cache), "--max-new-tokens", "16"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "lookahead"]
    two = subprocess.run([*torchrun, *args], capture_output=True, text=True, env={**ENV, "TMPDIR": str(tmp_path)},
                         timeout=300)
    one = subprocess.run([*command(), *args, "-W", "2", "-G", "10", "--fixed-steps"], capture_output=True, text=True,
                         env=ENV, timeout=600)
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    assert two.stdout == one.stdout and two.stdout.strip()
    summary = two.stderr.strip().splitlines()[-1]
    assert summary.startswith("[lookahead W=2 N=4 G=10 on 2 processes]"), two.stderr
    assert "tok/s (float32; plain ~" in summary  # issue 28 item 14: the baseline, timed on rank 0
    assert summary.split("]")[1].split(", S=")[0] == one.stderr.strip().splitlines()[-1].split("]")[1].split(", S=")[0]
    assert two.stderr.count("lookahead: loading") == 1
    assert not list(tmp_path.glob("torchelastic_*"))
