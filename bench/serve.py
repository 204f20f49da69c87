"""The server under an open-loop load: lookahead against plain decoding (`lookahead serve` with and without
`--no-lookahead`), time to first token, per-token latency and throughput against the arrival rate.

For each arrival rate, requests arrive as a Poisson process (exponential gaps, a fixed seed): chat prompts of
bench/data/dev.jsonl, streamed through the `openai` client, greedy, `max_tokens` each. The two servers run one after
the other on the same arrivals (never at once: they would share the CPU), their order alternating from rate to rate;
each is started fresh on a free port of 127.0.0.1 and stopped by SIGTERM after its load. Reports per (rate, method):
time to first token (p50, p99), per-token latency after the first (p50, p99 of each request's mean gap), throughput
(all answers' tokens over the time from the first arrival to the last answer), and how many answers the two servers
gave alike. Saves JSON and a PNG.

    python bench/serve.py --quick       # 6 requests per rate, 2 rates, 48 tokens
    python bench/serve.py               # 16 requests per rate, 4 rates, 96 tokens
    python bench/serve.py --compare prefix --name serve-prefix   # the prefix cache on and off, one system prompt
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import asyncio  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

from paging import SYSTEM  # noqa: E402

from common import load_prompts, machine, print_table, save_json  # noqa: E402

COMPARISONS = {  # --compare: the two servers, by their flags
    "lookahead": {"lookahead": [], "plain": ["--no-lookahead"]},
    "prefix": {"prefix cache": [], "no prefix cache": ["--no-prefix-cache"]},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH_TRIES = 3  # fresh ports a server is started on before giving up, when another process took its port first


def launch(command: list[str], name: str, ready: str, timeout_s: float,
           env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`command` (with "{port}" where a free port of 127.0.0.1 goes) started, with this environment plus `env` less
    the variables `drop` names (ours, such as OMP_WAIT_POLICY, kept from a peer); returns (the process, its URL) once
    GET `ready` answers 200 from it, or raises with the tail of its output (kept in a file: a pipe nobody reads would
    stall a talkative server).

    The port is picked free and handed over, so another process may bind it first (a test's server beside this one):
    what answers is then checked to be this process (`listeners`), and where it is not, the server is started again
    on another port; measuring another process's answers would be worse than failing."""
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop}
    for _ in range(LAUNCH_TRIES):
        port = free_port()
        log = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen([part.replace("{port}", str(port)) for part in command], stdout=log,
                                   stderr=subprocess.STDOUT, text=True, env=environment)
        url = f"http://127.0.0.1:{port}"
        if _answers(process, log, name, f"{url}{ready}", timeout_s):
            owners = listeners(port)
            if owners is None or any(_descends(pid, process.pid) for pid in owners):
                return process, url
        process.kill()  # another process answered on its port: it lost the race to bind it
        process.wait(30)
    raise RuntimeError(f"{name}: another process answered on each of {LAUNCH_TRIES} free ports it was started on")


def _answers(process: subprocess.Popen, log, name: str, url: str, timeout_s: float) -> bool:
    """Whether GET `url` answers 200 within `timeout_s` while `process` runs; raises with its output if it exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} exited with {process.returncode}: {log.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{name} did not answer {url} within {timeout_s:.0f} s")


def listeners(port: int) -> set[int] | None:
    """The processes holding a TCP socket that listens on `port`, from Linux's /proc (None elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl, local address (hex ip:port), remote, state (0A: listen), ..., inode (10th)
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes and not os.path.exists("/proc/net/tcp"):
        return None
    owners = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                owners.add(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return owners


def _descends(pid: int, root: int) -> bool:
    """Whether process `pid` is `root` or one of its descendants (a server's worker may hold its socket)."""
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid, after the command's name
        except OSError:
            return False
    return False


def start_server(extra: list[str], max_batch: int) -> tuple[subprocess.Popen, str]:
    """`lookahead serve` on a free port; returns once /health answers (or raises with its output)."""
    return launch([sys.executable, "-m", "lookahead", "serve", "--port", "{port}", "--max-batch", str(max_batch),
                   *extra], "the server", "/health", 600)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_request(client, model: str, messages: list[dict], max_tokens: int, delay: float, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    times, pieces = [], []
    stream = await client.chat.completions.create(model=model, messages=messages,
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    gaps = (times[-1] - times[0]) / max(tokens - 1, 1) if times else float("nan")
    return {"sent": sent - start, "ttft": (times[0] if times else done) - sent, "per_token": gaps,
            "tokens": tokens, "done": done - start, "text": "".join(pieces)}


async def load(url: str, conversations: list[list[dict]], rate: float, max_tokens: int, seed: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in conversations:
        delays.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, model, messages, max_tokens, d, start)
                                      for messages, d in zip(conversations, delays, strict=True)))
    await client.close()
    return list(results)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rates", type=float, nargs="+", help="arrivals per second")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="lookahead",
                        help="lookahead against --no-lookahead, or the prefix cache against --no-prefix-cache (every "
                             "request then begins with one 300-token system prompt)")
    parser.add_argument("--name", default="serve")
    args = parser.parse_args()
    rates = args.rates or ([0.1, 0.4] if args.quick else [0.05, 0.1, 0.2, 0.4])
    count = args.requests or (6 if args.quick else 16)
    max_tokens = args.tokens or (48 if args.quick else 96)
    methods = COMPARISONS[args.compare]
    system = [{"role": "system", "content": SYSTEM}] if args.compare == "prefix" else []
    conversations = [[*system, {"role": "user", "content": row["prompt"]}] for row in load_prompts(None)][:count]
    records, summary = [], []
    for i, rate in enumerate(rates):
        order = list(methods) if i % 2 == 0 else list(reversed(methods))
        answers = {}
        for method in order:
            process, url = start_server(methods[method], args.max_batch)
            try:
                results = asyncio.run(load(url, conversations, rate, max_tokens, seed=i))
            finally:
                stop_server(process)
            answers[method] = [r["text"] for r in results]
            tokens = sum(r["tokens"] for r in results)
            span = max(r["done"] for r in results) - min(r["sent"] for r in results)
            row = {"rate": rate, "method": method, "requests": len(results), "tokens": tokens,
                   "throughput": tokens / span,
                   "ttft_p50": statistics.median(r["ttft"] for r in results),
                   "ttft_p99": percentile([r["ttft"] for r in results], 0.99),
                   "tpot_p50": statistics.median(r["per_token"] for r in results),
                   "tpot_p99": percentile([r["per_token"] for r in results], 0.99)}
            summary.append(row)
            records.append({**row, "results": [{k: v for k, v in r.items() if k != "text"} for r in results]})
            print(f"rate {rate}/s {method}: {row['throughput']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s, "
                  f"per token p50 {row['tpot_p50'] * 1e3:.0f} ms", flush=True)
        first, second = (answers[name] for name in methods)
        same = sum(a == b for a, b in zip(first, second, strict=True))
        for row in summary[-2:]:
            row["same"] = same
    print_table(["rate /s", "method", "tok/s", "TTFT p50 s", "TTFT p99 s", "ms/token p50", "ms/token p99", "same"],
                [[r["rate"], r["method"], f"{r['throughput']:.1f}", f"{r['ttft_p50']:.2f}", f"{r['ttft_p99']:.2f}",
                  f"{r['tpot_p50'] * 1e3:.0f}", f"{r['tpot_p99'] * 1e3:.0f}", f"{r['same']}/{r['requests']}"]
                 for r in summary])
    command = "python bench/serve.py" + (" --quick" if args.quick else "") + (
        f" --compare {args.compare} --name {args.name}" if args.compare != "lookahead" else "")
    path = save_json(args.name, {"machine": machine(), "command": command, "form": "tree", "max_tokens": max_tokens,
                                 "max_batch": args.max_batch, "compare": args.compare, "summary": summary,
                                 "records": records})
    plot(summary, list(methods), path.with_suffix(".png"))
    print(path)


def plot(summary: list[dict], methods: list[str], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for method in methods:
        rows = [r for r in summary if r["method"] == method]
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["throughput"] for r in rows], "o-", label=method)
        axes[1].plot(rates, [r["ttft_p50"] for r in rows], "o-", label=f"{method} p50")
        axes[1].plot(rates, [r["ttft_p99"] for r in rows], "x--", label=f"{method} p99")
        axes[2].plot(rates, [r["tpot_p50"] * 1e3 for r in rows], "o-", label=f"{method} p50")
        axes[2].plot(rates, [r["tpot_p99"] * 1e3 for r in rows], "x--", label=f"{method} p99")
    axes[0].set(xlabel="arrivals per second", ylabel="tokens/s", title="throughput")
    axes[1].set(xlabel="arrivals per second", ylabel="seconds", title="time to first token")
    axes[2].set(xlabel="arrivals per second", ylabel="ms", title="per-token latency")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
