"""GGUF files against llama.cpp on the same file, in-process, each engine at its own defaults.

On SmolLM2-135M made into Q8_0 and Q4_K_M by llama.cpp's own tools (its `convert_hf_to_gguf.py` on the converted
default model, then `llama-quantize`), and on a 1B-shaped LLaMA with random weights (SmolLM2's vocabulary, hidden
2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192) made the same way:

- decode speed, one request: llama.cpp's `llama-bench` tg (its default: threads spin) against our `Llama.generate`,
  plain and with the default lookahead, on held-out prompts (ours as the `lookahead` command runs:
  OMP_WAIT_POLICY=PASSIVE);
- a step's cost t(T) / t(1) for T = 1..32: llama.cpp's `pp T` against our prompt-chunk steps of T tokens;
- effective memory bandwidth (the weights a token reads x tokens/s) against this machine's copy bandwidth;
- exactness (SmolLM2's files): lookahead (fixed 1-4-5 and 10-5-20, and the default) gives plain greedy's tokens on 9
  held-out prompts, and a batch of 3 gives each alone;
- agreement with llama.cpp (SmolLM2's files): greedy tokens of ours and of `llama-server` on 16 held-out prompts (the
  two sum in other orders, so they need not agree: how often, and where they first differ);
- our resident memory against the file's size.

llama.cpp's binaries come from `--llama-cpp DIR` or are built from the llama.cpp inside llama-cpp-python's source
package (`--build`, about 15-50 minutes on 2 cores; cached in the cache folder).

    python bench/quantized.py --build              # everything (about 30 minutes after the build)
    python bench/quantized.py --models smollm2     # the 135M files only
    python bench/quantized.py --quick              # one file, 2 prompts, 16 tokens; saves nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # ours, as the `lookahead` command sets it (never the peers')

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from serve import launch, stop_server  # noqa: E402

from common import LLAMA_CPP_PYTHON, RESULTS, chat_ids, held_out, machine, print_table, save_json  # noqa: E402
from lookahead import LookaheadConfig  # noqa: E402
from lookahead.loop import RowStep  # noqa: E402
from lookahead.models import Llama, default_model_dir  # noqa: E402
from lookahead.models.gguf import gguf_tokenizer, read  # noqa: E402
from lookahead.models.runner import CachedRunner  # noqa: E402
from lookahead.paths import cache_root  # noqa: E402

TOOLS = ("llama-bench", "llama-server", "llama-quantize")
SIZES = (1, 2, 4, 8, 16, 32)  # step sizes of the t(T) curves
ONE_B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
PEER_ENV_DROP = ("OMP_WAIT_POLICY",)  # ours; llama.cpp runs at its own default (spinning threads)


def peer_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PEER_ENV_DROP}


def work_dir() -> Path:
    root = cache_root()
    if root is None:
        raise SystemExit("no cache folder: set LOOKAHEAD_CACHE_DIR")
    return root / "gguf-bench"


LLAMA_CPP_SOURCE = f"llama_cpp_python-{LLAMA_CPP_PYTHON.split('==')[1]}/vendor/llama.cpp"  # in its source package


def llama_cpp_source(folder: Path) -> Path:
    """llama.cpp's source, from LLAMA_CPP_PYTHON's source package (downloaded once into `folder`)."""
    source = folder / LLAMA_CPP_SOURCE
    if not source.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"fetching {LLAMA_CPP_PYTHON}'s source ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", str(folder)], check=True)
        subprocess.run(["tar", "xzf", str(next(folder.glob("llama_cpp_python-*.tar.gz"))), "-C", str(folder)],
                       check=True)
    return source


def build_llama_cpp(source: Path) -> Path:
    """llama.cpp's CPU binaries, built once with cmake (its defaults, native CPU) into source/build/bin."""
    bin_dir = source / "build" / "bin"
    if all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    print("building llama.cpp (once; 15-50 minutes on 2 cores) ...", flush=True)
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", *TOOLS], cwd=source,
                   check=True)
    return bin_dir


def convert(source: Path, folder: Path, out: Path, outtype: str) -> None:
    """llama.cpp's converter on a Hugging Face folder (it needs sentencepiece importable, even for BPE vocabularies)."""
    if out.is_file():
        return
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    out.parent.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                          "--outfile", str(out)], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {folder} (pip install sentencepiece, if it says so):\n"
                         f"{run.stderr[-1500:]}")


def quantize(bin_dir: Path, base: Path, kind: str) -> Path:
    out = base.with_name(base.name.replace("-F32", f"-{kind}").replace("-F16", f"-{kind}"))
    if not out.is_file():
        subprocess.run([str(bin_dir / "llama-quantize"), str(base), str(out), kind], check=True, capture_output=True,
                       env=peer_env())
    return out


def one_b_folder(folder: Path) -> Path:
    """A 1B-shaped LLaMA with random weights (std 0.02) and SmolLM2's tokenizer and chat template, saved once in
    bfloat16."""
    if (folder / "config.json").is_file():
        return folder
    import transformers

    smol = default_model_dir()
    config = transformers.LlamaConfig(vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                      **ONE_B)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):
        if (smol / name).is_file():
            shutil.copy(smol / name, folder / name)
    return folder


def llama_bench(bin_dir: Path, path: Path, threads: int, repetitions: int) -> dict:
    """llama-bench's tg128 and pp T (tokens/s), at its defaults but the thread count."""
    run = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), "-p",
                          ",".join(map(str, SIZES)), "-n", "128", "-r", str(repetitions), "-o", "json"],
                         capture_output=True, text=True, env=peer_env(), check=True)
    rows = json.loads(run.stdout)
    pp = {row["n_prompt"]: row["avg_ts"] for row in rows if row["n_gen"] == 0}
    tg = next(row["avg_ts"] for row in rows if row["n_gen"] > 0)
    return {"tg_tok_s": tg, "step_ms": {T: 1e3 * T / pp[T] for T in SIZES}}


def step_ms(model, size: int, context: int = 64, repetitions: int = 9) -> float:
    """Our step of `size` prompt tokens at a context of about `context`: the median of `repetitions`."""
    runner = CachedRunner(model, (context + size * (repetitions + 3)) // 16 + 4, max_step_tokens=max(size, context))
    row, _ = runner.admit([], context + size * (repetitions + 3) + 8)
    runner.step([RowStep.chunk(row, list(range(5, 5 + context)))])
    runner.commit(row, list(range(context)))
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        runner.step([RowStep.chunk(row, list(range(7, 7 + size)))])
        times.append(time.perf_counter() - start)
        runner.commit(row, list(range(size)))
    return 1e3 * sorted(times)[len(times) // 2]


def decode_rate(model, prompts: list[list[int]], tokens: int, lookahead) -> tuple[float, list[list[int]]]:
    """Decoding tokens/s over the prompts, as llama-bench's tg counts them (from the first token, which the prompt's
    prefill gives, to the last: no prefill), each once after a warm-up of the first; and the answers."""
    model.generate(prompts[0], max_new_tokens=8, lookahead=lookahead)
    answers, decoded, seconds = [], 0, 0.0
    for ids in prompts:
        stamps: list[tuple[float, int]] = []

        def stamp(new: list[int], stamps=stamps) -> None:
            stamps.append((time.perf_counter(), len(new)))

        out = model.generate(ids, max_new_tokens=tokens, eos_token_id=[], lookahead=lookahead, stream=stamp).tokens
        answers.append(out)
        decoded += len(out) - stamps[0][1]
        seconds += stamps[-1][0] - stamps[0][0]
    return decoded / seconds, answers


def exactness(model, prompts: list[list[int]], tokens: int) -> dict:
    """Whether lookahead (fixed 1-4-5, 10-5-20, the default) and a batch of 3 give plain greedy's tokens."""
    plain = [model.generate(ids, max_new_tokens=tokens, eos_token_id=[]).tokens for ids in prompts]
    configs = {"1-4-5": LookaheadConfig(1, 4, 5, budget="fixed"), "10-5-20": LookaheadConfig(10, 5, 20, budget="fixed"),
               "default": LookaheadConfig()}
    result = {name: sum(model.generate(ids, max_new_tokens=tokens, eos_token_id=[], lookahead=config).tokens == want
                        for ids, want in zip(prompts, plain, strict=True)) for name, config in configs.items()}
    batch = model.generate(prompts[:3], max_new_tokens=tokens, eos_token_id=[], lookahead=configs["10-5-20"])
    result["batch of 3"] = sum(r.tokens == want for r, want in zip(batch, plain[:3], strict=True))
    result["prompts"] = len(prompts)
    return result


def llama_server_tokens(bin_dir: Path, path: Path, prompts: list[list[int]], tokens: int, threads: int) -> list:
    """llama-server's greedy tokens for each prompt (token ids in, token ids out; no prompt cache)."""
    process, url = launch([str(bin_dir / "llama-server"), "-m", str(path), "--host", "127.0.0.1", "--port", "{port}",
                           "-t", str(threads), "-c", "4096"], "llama-server", "/health", 300, drop=PEER_ENV_DROP)
    try:
        out = []
        for ids in prompts:
            body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                               "return_tokens": True, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                out.append(json.loads(response.read())["tokens"])
        return out
    finally:
        stop_server(process)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
             for x, y in zip(ours, theirs, strict=True)]
    return {"identical": sum(f is None for f in first), "prompts": len(first),
            "first_difference": [f for f in first if f is not None]}


def copy_bandwidth() -> float:
    """This machine's copy bandwidth (GB/s, bytes read + written), STREAM's copy on 2 x 256 MiB with torch's threads."""
    a, b = torch.ones(2**26), torch.empty(2**26)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


MEMORY = """
import json, os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from lookahead.models import Llama

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss()
model = Llama.from_pretrained(sys.argv[1])
loaded = rss()
model.generate(list(range(100, 164)), max_new_tokens=64, eos_token_id=[])
pool = model.runner.pool
kv = sum(t.numel() * t.element_size() for t in (pool.k, pool.v)) / 2**20
print(json.dumps({"base_mb": base, "after_load_mb": loaded - base, "after_decode_mb": rss() - base, "kv_mb": kv}))
"""


def memory(path: Path) -> dict:
    """Resident memory in a fresh process (MB): torch and the package imported (the base), then the model loaded, then
    64 tokens decoded after a 64-token prompt, each over the base; and the KV pool's size."""
    run = subprocess.run([sys.executable, "-c", MEMORY, str(path)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def weight_bytes(path: Path) -> tuple[int, int]:
    """(bytes of all tensors, bytes a decoded token reads: all but an untied embedding, of which it reads a row)."""
    tensors = read(path).tensors
    names = {t.name for t in tensors}
    total = sum(int(t.n_bytes) for t in tensors)
    embedding = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    return total, total - (embedding if "output.weight" in names else 0)


def measure(path: Path, bin_dir: Path, args, bandwidth: float) -> dict:
    print(f"\n== {path.name}", flush=True)
    tokenizer = gguf_tokenizer(path)
    rows = held_out(max(args.prompts, 16))
    if getattr(tokenizer, "chat_template", None):
        prompts = [chat_ids(tokenizer, row["prompt"]) for row in rows]
    else:  # the 1B shape's file: SmolLM2's vocabulary without its chat template
        prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    model = Llama.from_pretrained(path)
    total, per_token = weight_bytes(path)
    result = {"file": path.name, "file_mb": path.stat().st_size / 2**20, "weights_mb": total / 2**20}
    plain_rate, plain_answers = decode_rate(model, prompts[:args.prompts], args.tokens, None)
    lookahead_rate, lookahead_answers = decode_rate(model, prompts[:args.prompts], args.tokens, LookaheadConfig())
    result.update(ours_plain_tok_s=plain_rate, ours_lookahead_tok_s=lookahead_rate,
                  lookahead_equals_plain=lookahead_answers == plain_answers, memory=memory(path))
    model.release()  # the step curve's runners size the attention backend for themselves: no generation after them
    result["ours_step_ms"] = {T: step_ms(model, T) for T in SIZES}
    peer = llama_bench(bin_dir, path, args.threads, args.repetitions)
    result.update(llama_cpp_tg_tok_s=peer["tg_tok_s"], llama_cpp_step_ms=peer["step_ms"])
    result["bandwidth_gb_s"] = {"ours plain": per_token * plain_rate / 1e9,
                                "llama.cpp": per_token * peer["tg_tok_s"] / 1e9, "machine copy": bandwidth}
    if not args.quick and "1b-shape" not in path.name:  # random weights: speed only
        model = Llama.from_pretrained(path)
        result["exactness"] = exactness(model, prompts[:9], args.tokens)
        ours = [model.generate(ids, max_new_tokens=64, eos_token_id=[]).tokens for ids in prompts[:16]]
        theirs = llama_server_tokens(bin_dir, path, prompts[:16], 64, args.threads)
        result["agreement"] = agreement(ours, theirs)
    print(json.dumps(result, indent=1), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a folder with llama.cpp's llama-bench, llama-server, "
                        "llama-quantize (default: built from source with --build, or found in the cache)")
    parser.add_argument("--build", action="store_true", help="build llama.cpp from source if not built yet")
    parser.add_argument("--models", nargs="+", default=["smollm2", "1b"], choices=["smollm2", "1b"])
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M"])
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts timed per file (default 6)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3, help="llama-bench's -r")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 Q8_0, 2 prompts, 16 tokens; saves nothing")
    parser.add_argument("--name", default="quantized", help="the result file's name (before its device tag)")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure the saved results' files' memory again, in fresh processes, and save")
    args = parser.parse_args()
    if args.memory_only:
        saved = json.loads((RESULTS / "quantized-cpu.json").read_text())
        for r in saved["results"]:
            r["memory"] = memory(work_dir() / r["file"])
            print(r["file"], r["memory"], flush=True)
        saved["memory_machine"] = machine()  # the memory figures' commit, where it differs from the speed's
        save_json("quantized", saved)
        return
    if args.quick:
        args.models, args.types, args.prompts, args.tokens, args.repetitions = ["smollm2"], ["Q8_0"], 2, 16, 1
    work = work_dir()
    source = llama_cpp_source(work.parent / "llama.cpp-src")
    bin_dir = args.llama_cpp or (build_llama_cpp(source) if args.build else source / "build" / "bin")
    missing = [tool for tool in TOOLS if not (bin_dir / tool).is_file()]
    if missing:
        raise SystemExit(f"llama.cpp's {', '.join(missing)} not in {bin_dir}: pass --build (or --llama-cpp DIR)")
    torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth()
    files = []
    if "smollm2" in args.models:
        base = work / "SmolLM2-135M-Instruct-F32.gguf"
        convert(source, default_model_dir(), base, "f32")
        files += [quantize(bin_dir, base, kind) for kind in args.types]
    if "1b" in args.models:
        base = work / "llama-1b-shape-F16.gguf"
        convert(source, one_b_folder(work / "llama-1b-shape"), base, "f16")
        files += [quantize(bin_dir, base, kind) for kind in args.types]
    results = [measure(path, bin_dir, args, bandwidth) for path in files]
    headers = ["file", "llama.cpp tg", "ours plain", "ours lookahead", "plain / llama.cpp", "lookahead / llama.cpp",
               "t(8)/t(1) ours / llama.cpp", "GB/s ours / llama.cpp / copy"]
    table = []
    for r in results:
        ours, theirs = r["ours_step_ms"], r["llama_cpp_step_ms"]
        bw = r["bandwidth_gb_s"]
        table.append([r["file"], f"{r['llama_cpp_tg_tok_s']:.1f}", f"{r['ours_plain_tok_s']:.1f}",
                      f"{r['ours_lookahead_tok_s']:.1f}", f"{r['ours_plain_tok_s'] / r['llama_cpp_tg_tok_s']:.2f}x",
                      f"{r['ours_lookahead_tok_s'] / r['llama_cpp_tg_tok_s']:.2f}x",
                      f"{ours[8] / ours[1]:.2f} / {theirs[8] / theirs[1]:.2f}",
                      f"{bw['ours plain']:.1f} / {bw['llama.cpp']:.1f} / {bw['machine copy']:.1f}"])
    print()
    print_table(headers, table)
    if not args.quick:
        path = save_json(args.name, {"machine": machine(), "threads": args.threads, "tokens": args.tokens,
                                     "prompts": args.prompts, "results": results})
        print(f"saved {path}")


if __name__ == "__main__":
    main()
