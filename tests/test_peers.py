"""bench/peers.py's quick path (issue 36 item 3): our plain and lookahead servers on a tiny model, through their
OpenAI endpoints, in CI where llama.cpp and vLLM are not installed: it skips them, saying why, and measures ours; and
the benchmarks' servers answer for themselves (bench/serve.py's `launch`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_run_measures_our_servers_and_names_the_peers_it_skipped(served_dir, tmp_path):
    no_llama = tmp_path / "python-without-llama-cpp"  # any Python where `import llama_cpp.server` fails
    no_llama.write_text("#!/bin/sh\nexit 1\n")
    no_llama.chmod(0o755)
    run = subprocess.run([sys.executable, "bench/peers.py", "--quick", "--model", str(served_dir), "--dtypes",
                          "float32", "--no-llama-server", "--llama-python", str(no_llama), "--vllm",
                          str(tmp_path / "no-vllm")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PATH": os.path.dirname(sys.executable)})  # no aiperf, no vllm on PATH
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tables = [line.split("|") for line in run.stdout.splitlines() if line.startswith("ours ")]
    rows = [row for row in tables if len(row) == 10]  # the load's table (the prefill's has 6 columns)
    measured = {(row[0].strip(), row[2].strip()) for row in rows}
    assert measured == {(f"ours {method}", c) for method in ("plain", "lookahead") for c in ("1", "2")}
    for row in rows:
        assert float(row[3]) > 0  # tokens/s
        if row[0].strip() == "ours lookahead":  # greedy: the lookahead server answers as the plain one
            same, total = map(int, row[8].split("/"))
            assert same == total > 0
    prefill = [row for row in tables if len(row) == 6]  # engine, dtype, prompt tokens, seconds, tokens/s, ratio
    assert [(row[0].strip(), row[2].strip()) for row in prefill] == [("ours plain", "64")]
    assert len(prefill) == 1 and float(prefill[0][3]) > 0 and float(prefill[0][4]) > 0
    assert "skipped llama.cpp: `import llama_cpp.server` failed" in run.stdout
    assert "skipped vLLM: no `vllm` executable" in run.stdout


def test_a_server_another_process_answers_for_is_started_again_on_another_port(monkeypatch):
    """bench/serve.py's `launch` hands a server a port it found free; a process that binds it first (another test's
    server) answers in its place, and its answers must not be measured as the server's: the server is started again
    on another port, and what answers there is the server."""
    import http.server
    import threading

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import serve
    finally:
        sys.path.pop(0)

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the handler's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    free = serve.free_port()
    ports = iter([other.server_port, free])
    monkeypatch.setattr(serve, "free_port", lambda: next(ports))
    # the server binds a second after it starts (as a model's loading delays it), so the other one answers first
    script = ("import http.server, sys, time; time.sleep(1); "
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)"
              ".serve_forever()")
    try:
        process, url = serve.launch([sys.executable, "-c", script, "{port}"], "the server", "/", 60)
        try:
            assert url == f"http://127.0.0.1:{free}"
            assert serve.listeners(free) == {process.pid}
            assert serve.listeners(other.server_port) == {os.getpid()}
        finally:
            process.kill()
            process.wait(10)
    finally:
        other.shutdown()
        other.server_close()
