"""`lookahead serve`: its help answers before torch or fastapi load, bad flags are one line naming the flag, and the
real command stops on SIGTERM (or Ctrl-C's SIGINT) mid-stream: the stream ends with a last chunk, the process exits
0 within seconds."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lookahead.cli import build_parser, check_args, main
from served import ServeProcess, open_stream, read_event, request

FLAGS = ("--model", "--cache-dir", "--host", "--port", "--served-model-name", "--api-key", "--allowed-origins",
         "--max-batch", "--max-queue", "--kv-cache-gb", "--max-body-bytes", "--window", "--ngram", "--guesses",
         "--no-lookahead", "--fixed-steps", "--log-level", "--dtype", "--device", "--attn-backend", "--fusion",
         "--debug", "--max-model-len")

HELP = """
import sys
from lookahead.cli import main
try:
    main(["serve", "--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "fastapi", "uvicorn", "transformers"})),
      file=sys.stderr)
"""


def test_help_lists_the_flags_without_loading_torch_or_fastapi():
    run = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "", f"--help loaded {run.stderr.strip()}"
    for flag in FLAGS:
        assert flag in run.stdout, flag
    assert "LOOKAHEAD_API_KEY" in run.stdout and "127.0.0.1" in run.stdout


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--port", "http"], "argument --port: invalid int value"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 1"),
    (["--kv-cache-gb", "-2"], "--kv-cache-gb must be a number of GiB > 0"),
    (["--kv-cache-gb", "nan"], "--kv-cache-gb must be a number of GiB > 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--api-key", " "], "--api-key is empty"),
    (["--host", ""], "--host is empty"),
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["-W", "0"], "--window/-W must be >= 1"),
    (["-N", "1"], "--ngram/-N must be >= 2"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--model", "/nonexistent/model"], "is not a folder"),
    (["-m", "/nonexistent/model"], "is not a folder"),
    (["HuggingFaceTB/SmolLM2-135M-Instruct"], "looks like a Hugging Face hub id, and this command does not download"),
    (["/nonexistent/a", "--model", "/nonexistent/b"], "two models"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--log-level", "loud"], "argument --log-level: invalid choice"),
], ids=lambda v: "=".join(v) if isinstance(v, list) else None)
def test_bad_flags_are_one_line_naming_the_flag(capsys, argv, message):
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals (a type, a choice)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_without_the_serve_extra_the_error_names_it(capsys, monkeypatch, served_dir):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed (import fastapi raises)
    monkeypatch.setitem(sys.modules, "lookahead.serve", None)  # (imported by this module already: forgotten)
    assert main(["serve", "--model", str(served_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "needs the [serve] extra (fastapi not installed)" in err and "torch==2.13.0" in err, err
    # issue 49: the pin alone takes PyPI's CUDA build; the hint says where the CPU wheel is
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in err, err


def test_the_model_as_vllm_and_llama_server_take_it(served_dir):
    for argv in (["serve", str(served_dir)], ["serve", "-m", str(served_dir)], ["serve", str(served_dir), "--model",
                                                                                 str(served_dir)]):
        args = build_parser().parse_args(argv)
        check_args(args, {})
        assert args.model == str(served_dir), argv


def test_the_soft_limit_of_open_files_is_raised_to_the_hard_one():
    import resource

    from lookahead.cli.serve import raise_file_limit

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        hard = before[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        assert raise_file_limit() == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raise_file_limit() == want  # already raised: nothing changes
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_api_key_comes_from_the_environment_unless_given():
    parse = build_parser().parse_args
    args = parse(["serve"])
    check_args(args, {"LOOKAHEAD_API_KEY": "from-env"})
    assert args.api_key == "from-env"
    args = parse(["serve", "--api-key", "flag"])
    check_args(args, {"LOOKAHEAD_API_KEY": "from-env"})
    assert args.api_key == "flag"
    args = parse(["serve"])
    check_args(args, {"LOOKAHEAD_API_KEY": ""})
    assert args.api_key is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_stream_ends_the_stream_with_a_last_chunk_and_exits_0(served_dir, tmp_path, signum):
    env = {**os.environ, "HOME": str(tmp_path), "OMP_WAIT_POLICY": "PASSIVE"}  # its cost model cached there
    launch = [str(served_dir), "--max-model-len", "510"] if signum == signal.SIGTERM else ["-m", str(served_dir)]
    server = ServeProcess([sys.executable, "-m", "lookahead", "serve", *launch, "--max-batch", "2",
                           "--served-model-name", "tiny", "--log-level", "warning"], env)
    try:
        port, said = server.port, server.said
        assert server.name == "tiny", said[-1]
        assert request(port, "GET", "/health", None, {})[0] == 200
        assert any(line.startswith("lookahead: KV cache: ") for line in said), "".join(said)
        length = request(port, "GET", "/v1/models", None, {})[2]["data"][0]["max_model_len"]
        assert length == (510 if signum == signal.SIGTERM else 512)
        conn, response = open_stream(port, "/v1/chat/completions", dict(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=480, ignore_eos=True,
            temperature=0, stream=True))
        for _ in range(3):
            assert read_event(response) not in (None, "[DONE]")
        stopped = time.monotonic()
        server.process.send_signal(signum)
        events = []
        while (data := read_event(response)) is not None:
            events.append(data)
        conn.close()
        assert events[-1] == "[DONE]", events[-3:]
        finish = [choice["finish_reason"] for data in events[:-1] for choice in json.loads(data)["choices"]]
        assert finish[-1] == "abort" and all(f is None for f in finish[:-1])
        assert server.process.wait(timeout=15) == 0
        assert time.monotonic() - stopped < 15
    finally:
        server.stop()


def test_what_the_server_loaded_is_kept_out_of_the_collectors_view():
    """`lookahead serve` freezes what it loaded before serving (`freeze_loaded`): a full collection over the model's
    and torch's objects paused the engine's thread beside a long prompt. Unfrozen after, for the tests' process."""
    import gc

    from lookahead.cli.serve import freeze_loaded

    loaded = {"weights": [1, 2, 3]}  # a dict: one of the collector's objects
    assert any(o is loaded for o in gc.get_objects())
    try:
        freeze_loaded()
        assert not any(o is loaded for o in gc.get_objects())  # frozen: no collection walks it
    finally:
        gc.unfreeze()
