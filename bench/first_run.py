"""One part of the first GPU run (`bench/gpu_first_run.sh` runs them in order, each in its own process under its own
time budget); every figure is one JSON line appended to `--out` and flushed as it is measured, and a part that runs
short of time writes why and returns.

(a) step_time: an 8B-shaped LLaMA, random bf16 weights, static steps and CUDA graphs: the time of a step of every
    padded step size (the largest step of each bucket, and the named settings' real steps) at L = 4k, 1k and 16k
    cached positions; plain decoding on its own runner (sized for one-token steps, as a plain generation's is).
(b) replay: a SmolLM2-135M-shaped model, random bf16 weights, graphed, replaying the steps the real SmolLM2 took
    on a CPU (bench/data/smollm2-traces.json, from bench/record_traces.py): tokens/s of plain and lookahead
    decoding for the same tokens, with the real model's S, and no model file on the GPU host.
(c) engine: the engine (`engine_for`) with 1, 8 and 32 requests at once, plain and lookahead rows, the SmolLM2 shape.
(d) batch_invariant: where `Llama` has `batch_invariant`, its bitwise tests (tests/test_batch_invariant.py) first, then
    the time of a plain and a lookahead step with the mode on and off; otherwise a line saying it is absent.

    python bench/first_run.py --part a --out first-run.jsonl --budget 150
    python bench/first_run.py --part a --out first-run.jsonl --budget 10 --dry-run   # a CPU: tiny shapes

A part's budget counts from its process's start (bench/gpu_first_run.sh passes the same moment as --deadline, where
its kill limit starts too): imports take 10-30 s on a loaded machine, and a clock started after them ran past the kill.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before the imports: a part's budget includes them

import os  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from common import LLAMA_8B, ROOT, machine, random_llama, timed  # noqa: E402
from lookahead import LookaheadConfig  # noqa: E402
from lookahead.kernels import StepPattern  # noqa: E402
from lookahead.loop import PLAIN_STEP, LookaheadLoop, path_step  # noqa: E402
from lookahead.models import Llama, LlamaConfig, engine_for  # noqa: E402
from lookahead.models.runner import BLOCK_SIZE, CachedRunner  # noqa: E402
from lookahead.request import GREEDY, Request  # noqa: E402

GPU = torch.cuda.is_available()
TRACES = ROOT / "bench" / "data" / "smollm2-traces.json"
SETTINGS = {"1-4-5": (1, 4, 5), "3-4-3": (3, 4, 3), "7-5-7": (7, 5, 7), "15-5-15": (15, 5, 15)}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5)


class Out:
    """The JSON lines of one part, each flushed to disk as written (a run cut short keeps every line before the cut),
    and the part's deadline: `budget` seconds after `start` (a `time.monotonic()`; default now), or `deadline` (epoch
    seconds, as `time.time()`) where that is sooner."""

    def __init__(self, path: Path, part: str, budget: float, dry: bool, start: float | None = None,
                 deadline: float | None = None) -> None:
        self.path, self.part, self.dry = path, part, dry
        self.start = time.monotonic() if start is None else start
        self.deadline = self.start + budget
        if deadline is not None:
            self.deadline = min(self.deadline, time.monotonic() + deadline - time.time())

    def line(self, kind: str, **fields) -> None:
        record = {"part": self.part, "kind": kind, "t": round(time.monotonic() - self.start, 2), **fields}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps(record), flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def late(self, need: float) -> bool:
        """Whether less than `need` seconds are left; if so, says so (one line) for the part."""
        if self.left() >= need:
            return False
        self.line("stopped", reason=f"{self.left():.0f} s left of the part's budget, the next measurement needs "
                                    f"about {need:.0f} s")
        return True


def setup(dry: bool) -> tuple[torch.dtype, str]:
    return (torch.float32, "cpu") if dry else (torch.bfloat16, "cuda")


def runner_of(model, max_step_tokens: int, positions: int, max_rows: int = 1) -> CachedRunner:
    """A runner of its own for these steps, static (padded to the step buckets) and graphed on CUDA."""
    blocks = max_rows * -(-(positions + max_step_tokens) // BLOCK_SIZE) + 1
    runner = CachedRunner(model, blocks, max_step_tokens, cuda_graphs=True, max_rows=max_rows)
    runner.static = True  # also on a CPU (the dry run): the padded path is what a GPU runs
    return runner


def full_step(w: int, n: int, g: int) -> tuple[StepPattern, list[int], list[int], dict]:
    """(pattern, tokens, logits rows, top-k/sampling requests) of a full static step of W-N-G, packed by the loop."""
    cfg = LookaheadConfig(w, n, g, budget="fixed", warm=False)
    loop = LookaheadLoop(cfg, list(range(1, 33)), 1, GREEDY, None, static=True)
    layout = loop.plan()
    return layout.pattern, layout.tokens, layout.rows, loop.step_requests(layout)


def time_step(seq, pattern: StepPattern, tokens, rows, requests: dict, length: int, repeats: int) -> tuple[float,
                                                                                                        float]:
    """(seconds of the first step: kernels compiled and graph captured where new, median seconds of the others) at
    L = length (the cache content does not change the step's cost)."""
    seq.length = length
    with torch.inference_mode():
        _, first = timed(lambda: seq.step(tokens, pattern, rows, **requests))
        seq.step(tokens, pattern, rows, **requests)
        times = [timed(lambda: seq.step(tokens, pattern, rows, **requests))[1] for _ in range(repeats)]
    return first, statistics.median(times)


def splits_of(runner: CachedRunner, pattern: StepPattern) -> int | None:
    """The prefix splits the attention takes for this one-row step (None: the torch backend has none)."""
    plans = getattr(runner.backend, "plans", None)
    if not plans:
        return None
    plan = next(plan for tokens, plan in plans if tokens >= pattern.num_tokens)
    return plan.splits(1, runner.round_up(pattern.num_tokens))


def part_step_time(out: Out) -> None:
    dtype, device = setup(out.dry)
    shape, lengths, repeats = (TINY, (96, 32, 200), 3) if out.dry else (LLAMA_8B, (4096, 1024, 16384), 20)
    (model, seconds) = timed(lambda: random_llama(shape, dtype, device))
    out.line("model", shape="tiny" if out.dry else "8B", dtype=str(dtype), fusion=model.fusion,
             backend=model.attn_backend, build_s=round(seconds, 1))
    top = max(full_step(*s)[0].num_tokens for s in SETTINGS.values())  # 120: the self-tuned ceiling 15-5-15
    plain = runner_of(model, 1, max(lengths) + 16)  # plain decoding's runner: one-token steps
    wide = runner_of(model, top, max(lengths) + top + 16)
    sequences = {"plain": plain.sequence(max(lengths) + 16), "lookahead": wide.sequence(max(lengths) + top + 16)}
    # the largest step of each padded size (its bucket) up to the widest, then the settings' real steps
    largest = {}
    for t in range(2, top + 1):
        largest[wide.round_up(t)] = t
    steps = [("plain", "plain", PLAIN_STEP, [1], [0], {})]
    steps += [("lookahead", f"path{t}", path_step(t), [1] * t, list(range(t)), {}) for t in largest.values()]
    steps += [("lookahead", name, *full_step(*s)) for name, s in SETTINGS.items()]
    out.line("plan", lengths=list(lengths), buckets=sorted(largest), steps=[s[1] for s in steps],
             graphs=wide.cuda_graphs, static=wide.static)
    need = 1.0 if out.dry else 8.0  # a step's compile + capture + repeats, at most, once its kernels are built
    for length in lengths:  # every step size at one L before the next L: a cut run keeps whole curves
        for runner_name, name, pattern, tokens, rows, requests in steps:
            if out.late(need):
                return
            runner = plain if runner_name == "plain" else wide
            where = dict(runner=runner_name, config=name, T=pattern.num_tokens,
                         padded=runner.round_up(pattern.num_tokens), L=length, splits=splits_of(runner, pattern))
            measured = measure_step(out, runner, where, sequences[runner_name], pattern, tokens, rows, requests,
                                    length, repeats)
            if measured is not None:
                first, median = measured
                out.line("step", **where, ms=round(median * 1e3, 4), first_s=round(first, 3),
                         graphs=runner.cuda_graphs, repeats=repeats)


def measure_step(out: Out, runner: CachedRunner, where: dict, seq, pattern, tokens, rows, requests, length: int,
                 repeats: int) -> tuple[float, float] | None:
    """`time_step`, or None after an error line. Where a graphed step fails (its CUDA graph capture, say), the error is
    written and the runner measures without graphs from then on, this step again first: eager figures rather than
    none (the step lines say `graphs`)."""
    try:
        return time_step(seq, pattern, tokens, rows, requests, length, repeats)
    except Exception as e:  # noqa: BLE001 - an out-of-memory at one size leaves the others to measure
        out.line("error", **where, graphs=runner.cuda_graphs, error=f"{type(e).__name__}: {e}"[:500])
        if not runner.cuda_graphs:
            return None
    runner.cuda_graphs = False
    if GPU:
        torch.cuda.synchronize()
    out.line("graphs_off", **where, reason="the graphed step failed: this runner measures without CUDA graphs")
    try:
        return time_step(seq, pattern, tokens, rows, requests, length, repeats)
    except Exception as e:  # noqa: BLE001
        out.line("error", **where, graphs=False, error=f"{type(e).__name__}: {e}"[:500])
        return None


def traces(dry: bool) -> tuple[LlamaConfig, list[dict]]:
    """The recorded SmolLM2 config and traces (the dry run: a tiny config, the first trace of each setting, cut)."""
    payload = json.loads(TRACES.read_text(encoding="utf-8"))
    config = LlamaConfig.from_dict(payload["config"])
    if not dry:
        return config, payload["traces"]
    first = {}
    for trace in payload["traces"]:
        first.setdefault(trace["setting"], {**trace, "steps": trace["steps"][:6], "prompt_len": 16})
    return LlamaConfig(**TINY), list(first.values())


def replay(seq, trace: dict, vocab: int, plain: bool) -> tuple[int, float]:
    """(tokens committed, seconds) of decoding `trace` again after its prompt's prefill: its own steps, or as many
    one-token plain steps as it committed."""
    gen = random.Random(0)
    with torch.inference_mode():
        seq.prefill([gen.randrange(vocab) for _ in range(trace["prompt_len"])])
        steps = [{"W": 1, "N": 2, "tree_end": [], "rows": [0], "topk": 0, "commit": [0]}] * sum(
            len(s["commit"]) for s in trace["steps"]) if plain else trace["steps"]
        patterns = [PLAIN_STEP if s["W"] == 1 and s["N"] == 2 and not s["tree_end"] else
                    StepPattern(s["W"], s["N"], tree_end=tuple(s["tree_end"]) or None) for s in steps]
        tokens = [[gen.randrange(vocab) for _ in range(p.num_tokens)] for p in patterns]
        committed = 0

        def run():
            nonlocal committed
            for s, pattern, ids in zip(steps, patterns, tokens, strict=True):
                seq.step(ids, pattern, s["rows"], topk=s["topk"])
                seq.commit(s["commit"])
                committed += len(s["commit"])

        _, seconds = timed(run)
    return committed, seconds


# part (b)'s figures are the model's steps alone: the replay drafts, verifies and samples nothing, so its tokens/s is
# an upper bound on decoding's, not the command's (whose host work, measured on a CPU, is bench/host_time.py's)
MODEL_TIME_ONLY = "model time only: recorded steps replayed; no drafting, verification or sampling on the host"


def part_replay(out: Out) -> None:
    dtype, device = setup(out.dry)
    config, recorded = traces(out.dry)
    model = random_llama(config, dtype, device)
    out.line("model", shape="tiny" if out.dry else "SmolLM2-135M", dtype=str(dtype), traces=len(recorded))
    settings = sorted({t["setting"] for t in recorded})
    longest = max(t["prompt_len"] + t["new_tokens"] for t in recorded) + 128
    runners = {"plain": runner_of(model, 1, longest)}
    for setting in settings:
        runners[setting] = runner_of(model, full_step(*map(int, setting.split("-")))[0].num_tokens, longest)
    rounds = ["warm", "timed"] if out.dry else ["warm", "timed", "timed"]
    totals: dict = {}
    for r, kind in enumerate(rounds):  # warm: every shape compiled and captured before anything is timed
        for trace in recorded:
            for method in (["plain", trace["setting"]] if r % 2 == 0 else [trace["setting"], "plain"]):
                if out.late(1.0 if out.dry else 5.0):
                    return
                seq = runners[method].sequence(trace["prompt_len"] + trace["new_tokens"] + 128)
                try:
                    tokens, seconds = replay(seq, trace, config.vocab_size, method == "plain")
                finally:
                    seq.close()
                runners[method].clear_cache()
                if kind == "timed":
                    key = (trace["setting"], method == "plain")
                    total = totals.setdefault(key, [0, 0.0, 0])
                    total[0] += tokens
                    total[1] += seconds
                    total[2] += 1 if method == "plain" else 0
                    out.line("trace", setting=trace["setting"], kind_of_prompt=trace["kind"], method=method,
                             tokens=tokens, steps=tokens if method == "plain" else len(trace["steps"]),
                             tok_s=round(tokens / seconds, 1), timed=MODEL_TIME_ONLY)
    for setting in settings:
        look, plain = totals.get((setting, False)), totals.get((setting, True))
        if look and plain:
            steps = sum(len(t["steps"]) for t in recorded if t["setting"] == setting) * (len(rounds) - 1)
            rate, base = look[0] / look[1], plain[0] / plain[1]
            out.line("summary", setting=setting, S=round(look[0] / steps, 3), lookahead_tok_s=round(rate, 1),
                     plain_tok_s=round(base, 1), speedup=round(rate / base, 3), timed=MODEL_TIME_ONLY)


def part_engine(out: Out) -> None:
    dtype, device = setup(out.dry)
    config = LlamaConfig(**TINY) if out.dry else traces(False)[0]
    levels, new, prompt = ((1, 4), 6, 16) if out.dry else ((1, 8, 32), 64, 64)
    model = random_llama(config, dtype, device)
    cfg = LookaheadConfig(budget="fixed", warm=False)  # the package default's shape, full steps (no cost model)
    engine = engine_for(model, max_batch=max(levels), lookahead=cfg, warm=False)
    out.line("model", shape="tiny" if out.dry else "SmolLM2-135M", dtype=str(dtype), levels=list(levels),
             new_tokens=new, prompt_len=prompt)
    gen = random.Random(0)
    for c in levels:
        prompts = [[gen.randrange(config.vocab_size) for _ in range(prompt)] for _ in range(c)]
        answers = {}
        for round_ in ("warm", "timed"):
            for name, lookahead in (("plain", None), ("lookahead", cfg)):
                if out.late(2.0 if out.dry else 10.0):
                    return
                engine.model.clear_cache()
                handles = [engine.submit(Request([p], new, lookahead=lookahead)) for p in prompts]
                start = time.perf_counter()
                while not all(h.done for h in handles):
                    engine.step()
                seconds = time.perf_counter() - start
                results = [h.result() for h in handles]
                tokens = sum(len(r.tokens) for r in results)
                answers[name] = [r.tokens for r in results]
                if round_ == "timed":
                    out.line("engine", rows=c, method=name, tokens=tokens, seconds=round(seconds, 3),
                             tok_s=round(tokens / seconds, 1), S=round(tokens / sum(r.steps for r in results), 3),
                             same_as_plain=sum(a == b for a, b in zip(answers[name], answers["plain"], strict=True)))


# (name, options to `random_llama`): the default forward, the unfused one the mode runs, and the mode itself
MODES = [("default", {}), ("unfused", {"fusion": "none"}), ("invariant", {"fusion": "none", "batch_invariant": True})]


def part_batch_invariant(out: Out) -> None:
    """Where `Llama` has `batch_invariant`: the bitwise tests (tests/test_batch_invariant.py) first, with what is left
    but `TIMING_S`, then a plain and a 1-4-5 step in each of `MODES`, SmolLM2's shape, then the 8B shape (its mode
    only where the GPU has room for the mode's fp32 weight copies beside the bf16 ones: about 48 GB in all)."""
    if "batch_invariant" not in inspect.signature(Llama.__init__).parameters:
        out.line("skipped", reason="Llama has no batch_invariant argument in this checkout (the mode is not merged)")
        return
    config, lengths = (LlamaConfig(**TINY), (64,)) if out.dry else (traces(False)[0], (1024, 4096))
    tests = ROOT / "tests" / "test_batch_invariant.py"
    if out.dry:
        out.line("tests", ran=False, reason="the dry run does not run the bitwise tests", found=tests.is_file())
    elif not tests.is_file():
        out.line("tests", ran=False, reason=f"{tests.relative_to(ROOT)} is missing")
    elif out.left() > TIMING_S + 15:
        budget = out.left() - TIMING_S
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tests)]
        rc, lines = run_cut(command, budget)
        summary = lines[-1] if lines else ""
        if rc is None:
            summary = f"cut after {budget:.0f} s: {summary}"
        out.line("tests", ran=True, rc=rc, summary=summary, tail=lines[-40:])
    else:
        out.line("tests", ran=False, reason=f"{out.left():.0f} s left: too few for the tests and the timings")
    time_modes(out, "tiny" if out.dry else "SmolLM2-135M", config, lengths)
    if not out.dry:
        time_modes(out, "8B", LLAMA_8B, lengths)


TIMING_S = 25  # part (d)'s seconds kept for the SmolLM2-shaped timings after its tests


def run_cut(command: list[str], seconds: float) -> tuple[int | None, list[str]]:
    """(exit status, or None where it was cut; its output's lines) of `command` (a pytest run) given `seconds`: at the
    limit it gets SIGINT, so pytest stops and prints what ran (-rA names each test), then a kill 10 s later."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        output, _ = proc.communicate(timeout=seconds)
        return proc.returncode, output.strip().splitlines()
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return None, output.strip().splitlines()


def weight_bytes(shape) -> int:
    """Bytes of one copy of a LLaMA's weights at 1 byte a parameter (the embedding and the head counted apart)."""
    c = shape if isinstance(shape, LlamaConfig) else LlamaConfig(**shape)
    attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * (attention + mlp)


def room_for(options: dict, shape) -> str | None:
    """None where the GPU's free memory holds a model of `shape` in `options`' mode (bf16, plus the invariant mode's
    fp32 copies) with a fifth to spare; else why not. Always None on a CPU."""
    if not GPU:
        return None
    need = weight_bytes(shape) * (2 + (4 if options.get("batch_invariant") else 0)) * 1.2
    free = torch.cuda.mem_get_info()[0]
    if free >= need:
        return None
    return f"needs about {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free"


def time_modes(out: Out, shape_name: str, shape, lengths: tuple[int, ...]) -> None:
    """A plain and a 1-4-5 step at each L, on a model of each of `MODES`; a mode that fails writes its error."""
    dtype, device = setup(out.dry)
    for mode, options in MODES:
        if out.late(4.0 if out.dry else 20.0):  # a model built and its kernels compiled, at least
            return
        if out.dry and options.get("batch_invariant"):  # a dry run cut mid-compile leaves torch's build lock behind
            out.line("skipped", mode=mode, reason="the dry run does not build the mode: on a CPU its GEMM compiles "
                                                  "once per machine (about a minute)")
            continue
        short = room_for(options, shape)
        if short is not None:  # an out-of-memory midway could leave the device unusable for the parts after
            out.line("skipped", model=shape_name, mode=mode, reason=short)
            continue
        seq = None
        try:
            model = random_llama(shape, dtype, device, **options)
            seq = runner_of(model, 18, max(lengths) + 64).sequence(max(lengths) + 64)
            for name, (pattern, tokens, rows, requests) in (("plain", (PLAIN_STEP, [1], [0], {})),
                                                            ("1-4-5", full_step(1, 4, 5))):
                for length in lengths:
                    first, median = time_step(seq, pattern, tokens, rows, requests, length, 3 if out.dry else 20)
                    out.line("step", model=shape_name, mode=mode, fusion=model.fusion, config=name,
                             T=pattern.num_tokens, L=length, ms=round(median * 1e3, 4), first_s=round(first, 3))
        except Exception as e:  # noqa: BLE001 - the other modes and shapes still measure
            out.line("error", model=shape_name, mode=mode, error=f"{type(e).__name__}: {e}"[:500])
        finally:
            if seq is not None:
                seq.close()
            seq = model = None
            if GPU:
                torch.cuda.empty_cache()


PARTS = {"a": part_step_time, "b": part_replay, "c": part_engine, "d": part_batch_invariant}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=sorted(PARTS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file to append to")
    parser.add_argument("--budget", type=float, required=True, help="seconds this part may take")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU")
    parser.add_argument("--deadline", type=float, help="epoch seconds by which the part ends, if sooner than --budget "
                                                         "after the process started (the kill limit's start)")
    args = parser.parse_args()
    out = Out(args.out, args.part, args.budget, args.dry_run, start=STARTED, deadline=args.deadline)
    if not args.dry_run and not GPU:
        out.line("error", error="no CUDA GPU visible to torch: run with --dry-run on a CPU")
        return 2
    out.line("start", function=PARTS[args.part].__name__, budget_s=args.budget, dry_run=args.dry_run,
             machine=machine())
    try:
        PARTS[args.part](out)
    except Exception as e:  # noqa: BLE001 - a part's failure is a figure too; the next part runs in a new process
        traceback.print_exc()
        out.line("error", error=f"{type(e).__name__}: {e}"[:2000])
        return 1
    out.line("done")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every line is on disk (fsync'ed): skip the interpreter's teardown (torch's, the kernels' thread pools), which
    # took over 2 s on a loaded machine after "done" and ran the part into its kill limit
    os._exit(code)
