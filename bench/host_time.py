"""The engine's own host time per step (issue 36): everything an `Engine` step does besides the model's forward --
drafting, packing the step, verification, committing, the scheduler -- at 1, 8 and 32 concurrent lookahead rows.

The forward is an oracle that costs the host nothing it would not pay anyway: `StepProgram.forward` (the region a
CUDA graph replays on a GPU) is replaced by a look-up in token streams the real default model (SmolLM2-135M) produced
once (`--record`: greedy continuations of bench/data's prompts, and the model's top-8 at every position of them,
saved to bench/data/host-time-streams.json.gz). A step token whose context is the stream's own text gets the model's
real top-8 there (so acceptance is the real model's: a draft is accepted exactly where the model would accept it);
any other token gets the top-8 the model gave after the same two tokens (else the same token) in that stream, so the
lookahead branch and recycling see plausible text. The rest of the engine is the serving one: a paged
`CachedRunner`, a drafting memory warmed by earlier requests, self-tuned steps sized by a cost model (a synthetic
curve shaped like an 8B model's on one GPU; the engine's clock is simulated, so the budget's choices, and the steps,
do not depend on how fast the host is). The engine's tokens are checked against the streams.

Host time = wall time of `Engine.step` minus the time inside the oracle, averaged over the steps in which all N rows
decode (after every prefill, before the first row ends). A second pass splits it by phase (timers patched over the
methods that do each part: their own cost is a few us a row), a third profiles it (cProfile).

    python bench/host_time.py                      # 1, 8 and 32 rows; writes bench/results/host-time-cpu.json
    python bench/host_time.py --baseline DIR       # the same, alternating with the code of an exported tree DIR
    python bench/host_time.py --record             # re-record the streams (the default model, a few minutes)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from common import ROOT, machine, print_table, save_json  # noqa: E402
from lookahead import LookaheadConfig  # noqa: E402
from lookahead.drafts import DraftMemory  # noqa: E402
from lookahead.loop import Capacity, Engine  # noqa: E402
from lookahead.models import runner as runner_module  # noqa: E402
from lookahead.models.runner import CachedRunner  # noqa: E402
from lookahead.request import Request  # noqa: E402
from lookahead.tuning import CostModel, Curve  # noqa: E402

STREAMS = ROOT / "bench" / "data" / "host-time-streams.json.gz"
TOPK = 8  # the top-k recorded per position (the recycling source's RECYCLE_K)
ROWS = (1, 8, 32)
GC_MODE = "default"  # the garbage collector during the measured requests: "default", "freeze" or "off" (--gc)
WARM_ROWS = 3  # streams left out of the measured rows: an earlier request each, whose drafting warms the memory
# a step's seconds by its tokens, shaped like an 8B LLaMA's on one H100 (flat while weight reads dominate)
GPU_CURVE = Curve([1, 64, 128, 256, 512, 1024, 2048, 4096],
                  [0.0065, 0.0067, 0.0069, 0.0075, 0.0095, 0.015, 0.027, 0.052], [2e-8] * 8)


# ----- the streams -----


def record(tokens: int, path: Path) -> None:
    """Greedy continuations of every dev prompt by the default model, and its top-k at every position from the
    prompt's last on (one teacher-forced pass each). A stream is cut where the pass's argmax and the generation
    disagree (a near-tie rounded differently), so that it is one model's text."""
    from common import chat_ids, load_model, load_prompts

    _, model, tokenizer = load_model()
    streams = []
    with torch.inference_mode():
        prompts = [(row["kind"], chat_ids(tokenizer, row["prompt"])) for row in load_prompts()]
        results = model.generate([ids for _, ids in prompts], max_new_tokens=tokens, eos_token_id=[],
                                 lookahead=LookaheadConfig(budget="fixed"))
        for (kind, ids), result in zip(prompts, results, strict=True):
            sequence = ids + result.tokens
            top = model(torch.tensor([sequence]))[0, len(ids) - 1 :].topk(TOPK, dim=-1).indices.tolist()
            agree = next((i for i, row in enumerate(top[:-1]) if row[0] != result.tokens[i]), len(top) - 1)
            streams.append({"kind": kind, "prompt": ids, "tokens": result.tokens[:agree],
                            "topk": top[: agree + 1]})
    path.write_bytes(gzip.compress(json.dumps({"model": "SmolLM2-135M-Instruct", "topk": TOPK,
                                               "streams": streams}).encode()))
    print(f"{len(streams)} streams, {sum(len(s['tokens']) for s in streams)} tokens -> {path}")


def load_streams() -> list[dict]:
    """The recorded streams, interleaved by kind (chat, code, math, summarize, chat, ...) so any first N mix them."""
    streams = json.loads(gzip.decompress(STREAMS.read_bytes()))["streams"]
    kinds: dict[str, list[dict]] = {}
    for s in streams:
        kinds.setdefault(s["kind"], []).append(s)
    out = []
    while any(kinds.values()):
        for group in kinds.values():
            if group:
                out.append(group.pop(0))
    return out


class Stream:
    """One recorded stream as the oracle reads it: the text, the model's top-k after each position from the prompt's
    last on, and the fallback tables (the top-k after each (previous, token) pair and each token seen)."""

    def __init__(self, record: dict) -> None:
        self.prompt = record["prompt"]
        self.text = self.prompt + record["tokens"]
        self.first = len(self.prompt) - 1  # topk[i] is the model's top-k after position first + i
        self.topk = record["topk"]
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.single: dict[int, list[int]] = {}
        for i, row in enumerate(self.topk):
            position = self.first + i
            if position < len(self.text):
                self.pairs[(self.text[position - 1], self.text[position])] = row
                self.single[self.text[position]] = row
        self.default = self.topk[0]

    def top_after(self, position: int, on_text: bool, previous: int, token: int) -> list[int]:
        if on_text and 0 <= position - self.first < len(self.topk):
            return self.topk[position - self.first]
        return self.pairs.get((previous, token)) or self.single.get(token) or self.default


def tree_of(pattern) -> tuple[list[int], list[int]]:
    """Each step index's parent in its context (-1: none, the input token) and its relative position (computed here,
    not by the package, so that the profile of the engine holds none of the oracle's work)."""
    window, la, ends = pattern.window, pattern.lookahead_len, pattern.node_ends
    parents = [-1] + [i - 1 if i < window else i - window for i in range(1, la)]
    depths = [i // window + i % window for i in range(la)]
    open_nodes: list[int] = []  # the ancestors of the next node, deepest last
    for j in range(len(ends)):
        while open_nodes and ends[open_nodes[-1]] <= j:
            open_nodes.pop()
        parents.append(la + open_nodes[-1] if open_nodes else 0)
        depths.append(len(open_nodes) + 1)
        open_nodes.append(j)
    return parents, depths


class Oracle:
    """The stand-in forward: per packed row, its stream's top-k (see the module docstring). `seconds`: time spent in
    it; `now`: the simulated clock, advanced by each step's modelled cost."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.streams: dict[int, Stream] = {}  # runner row -> its stream
        self.by_prompt: dict[tuple[int, ...], Stream] = {}
        self.rows: list[int] = []  # the runner rows of the step being run, in packing order
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the thread's CPU time in it (other processes on a shared machine do not count)
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def forward(self, program, runner) -> tuple[torch.Tensor, torch.Tensor]:
        start, cpu = time.perf_counter(), time.thread_time()
        step, views, shape = program.step, program.views, program.shape
        tokens = views["tokens"].tolist()
        predicted: list[list[int]] = [[0] * TOPK] * len(tokens)
        for row, length, pattern, begin in zip(self.rows, step.lengths, step.patterns, step.starts, strict=True):
            stream = self.streams[row]
            own = tokens[begin : begin + pattern.num_tokens]
            parents, depths = tree_of(pattern)
            on = [False] * len(own)
            for i, token in enumerate(own):
                parent = parents[i]
                position = length + depths[i]
                on[i] = (parent < 0 or on[parent]) and position < len(stream.text) and stream.text[position] == token
                previous = own[parent] if parent >= 0 else stream.text[length - 1] if length else -1
                predicted[begin + i] = stream.top_after(position, on[i], previous, token)
        heads = views["head"].tolist()
        top = torch.tensor([predicted[h] for h in heads], dtype=torch.int64)
        fetched = top[:, 0] if not shape.topk else torch.cat([top[:, 0], top[:, : shape.topk].flatten()])
        mean_length = sum(step.lengths) // max(len(step.lengths), 1)
        self.now += self.cost.predict(shape.tokens, mean_length)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu
        return torch.zeros(len(heads), TOPK), fetched


class OracleProgram(runner_module.StepProgram):
    """A step program whose forward is its runner's oracle."""

    def forward(self, runner):
        return runner.oracle.forward(self, runner)


class OracleRunner(CachedRunner):
    """The paged runner, telling its oracle which stream each row decodes and which rows each step packs."""

    oracle: Oracle

    def admit(self, prompt, positions):
        place = super().admit(prompt, positions)
        if place is not None:
            self.oracle.streams[place[0]] = self.oracle.by_prompt[tuple(prompt)]
        return place

    def step(self, steps):
        self.oracle.rows = [s.row for s in steps]
        return super().step(steps)


def make_engine(oracle: Oracle, cfg: LookaheadConfig, max_rows: int, static: bool) -> Engine:
    """The serving engine over a paged runner whose programs' forward is the oracle's."""
    runner_module.StepProgram = OracleProgram  # what the runner builds its programs from (this process: the oracle)
    model = _stub_model()
    runner = OracleRunner(model, 64 * max_rows * 4, cfg.step_tokens, cuda_graphs=False, max_rows=max_rows)
    runner.oracle, runner.static = oracle, static
    capacity = Capacity(max_rows, vocab_size=model.config.vocab_size, lookahead=cfg)
    return Engine(runner, capacity=capacity, cost=oracle.cost, memory=DraftMemory(), clock=oracle.clock)


def _stub_model():
    """A one-layer LLaMA of SmolLM2's vocabulary and tiny width: only its config, device and dtype are read (its KV
    pool is a few bytes a position, so moving entries costs what a launch costs, not a copy)."""
    from common import random_llama

    shape = dict(vocab_size=49152, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                 num_key_value_heads=1, head_dim=8, max_position_embeddings=8192, rms_norm_eps=1e-5)
    model = random_llama(shape, torch.float32, "cpu", fusion="none", backend="torch")
    model.batch_invariant = False  # the attention backend is never called; the plain one sizes nothing
    return model


# ----- one measurement -----


def run_rows(streams: list[Stream], warm: list[Stream], cfg: LookaheadConfig, tokens: int, static: bool,
             timers=None, profile: cProfile.Profile | None = None) -> dict:
    """N = len(streams) concurrent requests through one engine (after the warm ones, one by one); the host time of
    the steps in which all N decode, and the engine's tokens checked against the streams."""
    oracle = Oracle(CostModel({"greedy": Curve(list(GPU_CURVE.knots), list(GPU_CURVE.base),
                                               list(GPU_CURVE.per_position))}))
    for s in [*streams, *warm]:
        oracle.by_prompt[tuple(s.prompt)] = s
    engine = make_engine(oracle, cfg, len(streams), static)
    # the earlier runs' engines are garbage in cycles: collected now, or a full collection's pause over them lands in
    # some phase of this run (it did: a phase 4x its size in one run, another's in the next)
    gc.collect()
    with torch.inference_mode():
        for s in warm:  # earlier requests: their drafting goes into the memory when they end
            engine.submit(Request([s.prompt], tokens, lookahead=cfg))
            while engine.step():
                pass
        if GC_MODE == "freeze":  # what the process holds so far (the memory's tables) is never scanned again
            gc.freeze()
        elif GC_MODE == "off":
            gc.disable()
        handles = [engine.submit(Request([s.prompt], tokens, lookahead=cfg)) for s in streams]
        host, host_cpu, inside_us, fed, accepted = [], [], [], [], []
        while True:
            # timed: the steps that start with all N rows decoding (the last one of each such run included)
            jobs = list(engine.active)
            full = len(jobs) == len(streams) and all(not job.prefilling for job in jobs)
            inside, inside_cpu = oracle.seconds, oracle.cpu_seconds
            start, cpu = time.perf_counter(), time.thread_time()
            if full and timers is not None:
                timers.on = True  # (the oracle's time inside the runner's step is taken out below)
            if full and profile is not None:
                profile.enable()
            more = engine.step()
            if full and profile is not None:
                profile.disable()
            if timers is not None:
                timers.on = False
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            if full:
                host.append(wall - (oracle.seconds - inside))
                host_cpu.append(cpu - (oracle.cpu_seconds - inside_cpu))
                inside_us.append((oracle.cpu_seconds - inside_cpu) * 1e6)
                fed.append(sum(job.out.result.step_sizes[-1] for job in jobs))
                accepted.append(sum(len(job.out.result.step_tokens[-1]) for job in jobs))
            if not more:
                break
    gc.enable()
    gc.unfreeze()
    for s, handle in zip(streams, handles, strict=True):
        got = handle.result().tokens
        want = s.text[len(s.prompt) :]
        n = min(len(got), len(want))
        if got[:n] != want[:n]:
            raise AssertionError("the engine's tokens left the recorded stream: the oracle or the engine is wrong")
    return {"steps": len(host), "host_us": [h * 1e6 for h in host], "host_cpu_us": [h * 1e6 for h in host_cpu],
            "oracle_cpu_us": statistics.fmean(inside_us),
            "tokens_fed": statistics.fmean(fed) if fed else 0,
            "tokens_per_step": statistics.fmean(accepted) if accepted else 0}


class PhaseTimers:
    """The thread's CPU seconds inside methods, patched over the classes that hold them, counted only while `on`;
    `phases` takes nested ones apart."""

    # phase -> (module, class, method); the parents' times include their children's
    TARGETS = {
        "draft": ("lookahead.loop.core", "LookaheadLoop", "draft"),
        "plan": ("lookahead.loop.scheduler", "Scheduler", "plan"),
        "layout": ("lookahead.loop.jobs", "Job", "plan"),
        "runner_step": ("lookahead.models.runner", "CachedRunner", "step"),
        "finish": ("lookahead.loop.jobs", "Job", "finish"),
        "verify": ("lookahead.loop.core", "LookaheadLoop", "_verify"),
        "learn": ("lookahead.loop.core", "LookaheadLoop", "_learn"),
        "runner_commit": ("lookahead.models.runner", "CachedRunner", "commit"),
    }

    def __init__(self) -> None:
        import importlib

        self.seconds = dict.fromkeys(self.TARGETS, 0.0)
        self.on = False
        for name, (module, owner, attribute) in self.TARGETS.items():
            cls = getattr(importlib.import_module(module), owner)
            setattr(cls, attribute, self._wrap(name, getattr(cls, attribute)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - start
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.TARGETS, 0.0)


def phases(total_us: float, timers: PhaseTimers, forward_us: float, steps: int) -> dict:
    """Per step, by phase (the thread's CPU time, out of `total_us`, the host's CPU time per step): draft; pack (the
    rows' layouts and the runner's packing, staging and unpacking around the forward); verify; commit (taking the
    outputs: the window, pool, recycling and suffix updates, and the runner's commit bookkeeping; `learn`, the
    recycling part, also shown apart); schedule (the rest: admission, the budget's sizing, sending, retiring)."""
    us = {name: s / steps * 1e6 for name, s in timers.seconds.items()}
    out = {
        "draft": us["draft"],
        "pack": us["layout"] + us["runner_step"] - forward_us,
        "verify": us["verify"],
        "commit": us["finish"] - us["verify"] + us["runner_commit"],
        "learn": us["learn"],
    }
    out["schedule"] = total_us - out["draft"] - out["pack"] - out["verify"] - out["commit"]
    return out


def config_of(spec: str) -> LookaheadConfig:
    if spec == "default":
        return LookaheadConfig()
    window, ngram, guesses = map(int, spec.split("-"))
    return LookaheadConfig(window, ngram, guesses)


def measure(args) -> dict:
    """One process's measurement at each row count: plain timings, the phases (their timers, once patched in,
    stay; off, they cost a flag test a call), then a profile at the most rows (last: in the code before this work, a
    1-row run after a profiled one ran 4x slower in all three rounds)."""
    torch.set_num_threads(1)
    cfg = config_of(args.config)
    streams = [Stream(r) for r in load_streams()]
    warm, pool = streams[:WARM_ROWS], streams[WARM_ROWS:]
    out = {"config": f"{cfg.window}-{cfg.ngram}-{cfg.guesses}", "rows": []}
    for n in args.rows:
        plain = [run_rows(pool[:n], warm, cfg, args.tokens, args.static) for _ in range(args.repeats)]
        host = [statistics.fmean(r["host_us"]) for r in plain]
        cpu = [statistics.fmean(r["host_cpu_us"]) for r in plain]
        out["rows"].append({"rows": n, "steps": plain[0]["steps"], "tokens_fed": plain[0]["tokens_fed"],
                            "tokens_per_step": plain[0]["tokens_per_step"], "host_us_runs": host,
                            "host_us": statistics.median(host), "host_us_per_row": statistics.median(host) / n,
                            "host_cpu_us_runs": cpu, "host_cpu_us": statistics.median(cpu)})
    if args.phases:
        timers = PhaseTimers()
        for entry in out["rows"]:
            timers.reset()
            timed = run_rows(pool[: entry["rows"]], warm, cfg, args.tokens, args.static, timers=timers)
            total = statistics.fmean(timed["host_cpu_us"])
            entry["phases_total_us"] = total
            entry["phases_us"] = phases(total, timers, timed["oracle_cpu_us"], timed["steps"])
    if args.profile:
        n = max(args.rows)
        profile = cProfile.Profile()
        steps = run_rows(pool[:n], warm, cfg, args.tokens, args.static, profile=profile)["steps"]
        out["rows"][-1]["profile_top"] = _profile_rows(pstats.Stats(profile, stream=io.StringIO()), args.profile,
                                                       steps)
    return out


def _profile_rows(stats: pstats.Stats, top: int, steps: int) -> list[dict]:
    """The `top` functions by own time, per step, the oracle's left out: its own functions, and what the functions it
    calls spent on its behalf (a `torch.tensor` of its top-k, say)."""
    rows = []
    for (path, line, name), (_, calls, own, cumulative, callers) in stats.stats.items():
        if Path(path).name == "host_time.py":
            continue
        for (caller, _, _), (_, oracle_calls, oracle_own, oracle_cumulative) in callers.items():
            if Path(caller).name == "host_time.py":
                calls, own, cumulative = calls - oracle_calls, own - oracle_own, cumulative - oracle_cumulative
        if calls > 0:
            rows.append({"function": f"{Path(path).parent.name}/{Path(path).name}:{line}({name})",
                         "calls_per_step": calls / steps, "own_us": own / steps * 1e6,
                         "cumulative_us": cumulative / steps * 1e6})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


# ----- the driver -----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--tokens", type=int, default=160, help="new tokens per request (the streams hold 160)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row count (the median is reported)")
    parser.add_argument("--config", default="default",
                        help="the requests' lookahead: 'default' (LookaheadConfig(): 1-4-5, self-tuned, warm), or "
                        "W-N-G for LookaheadConfig(W, N, G) likewise (4-5-30: a GPU server's auto)")
    parser.add_argument("--static", action="store_true", help="static steps, as a GPU runner pads them")
    parser.add_argument("--no-phases", dest="phases", action="store_false")
    parser.add_argument("--profile", type=int, default=25, help="profile the most rows' run: the top N functions")
    parser.add_argument("--baseline", type=Path, help="an exported tree of the code to compare with (its lookahead/, "
                        "kernels/, models/): each repeat runs both, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: alternations")
    parser.add_argument("--quick", action="store_true", help="1 and 8 rows, 24 tokens, one run (a test's check)")
    parser.add_argument("--gc", default="default", choices=("default", "freeze", "off"),
                        help="the garbage collector while the measured requests run (what its pauses cost)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--record", action="store_true", help="record the streams with the default model")
    parser.add_argument("--name", default="host-time")
    args = parser.parse_args()
    if args.record:
        record(args.tokens, STREAMS)
        return
    if args.quick:
        args.rows, args.tokens, args.repeats, args.profile, args.rounds = [1, 8], 24, 1, 0, 1
    if args.worker:
        global GC_MODE
        GC_MODE = args.gc
        print(json.dumps(measure(args)))
        return
    runs = {"after": []} if args.baseline is None else {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as copy:
        # beside a baseline, this checkout's code runs from a copy loaded as the baseline's is: an exported tree ran
        # 10-40% slower than the installed package with the very same code (on this 2-core machine, in one run)
        here = None if args.baseline is None else _export(ROOT, Path(copy))
        for _ in range(1 if args.baseline is None else args.rounds):
            for label in runs:
                runs[label].append(_worker(args, args.baseline if label == "before" else here))
    result = {"machine": machine(), "tokens": args.tokens, "config": args.config, "static": args.static,
              "load": os.getloadavg(), "runs": runs, "summary": _summary(runs)}
    _print(result)
    if not args.quick:
        print(save_json(args.name, result))


def _export(root: Path, folder: Path) -> Path:
    """The code of the checkout at `root` as it stands (edits included), copied into `folder`: its lookahead/,
    kernels/ and models/."""
    for name in ("lookahead", "kernels", "models"):
        shutil.copytree(root / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _worker(args, tree: Path | None) -> dict:
    """One measurement in a fresh process (of the code in `tree`, when given: its three folders as the packages)."""
    env = dict(os.environ)
    if tree is not None:
        shim = tree / ".host-time-packages"
        if not shim.is_dir():
            (shim / "lookahead").parent.mkdir(parents=True, exist_ok=True)
            (shim / "lookahead").symlink_to((tree / "lookahead").resolve())
            for name in ("kernels", "models"):
                link = tree / "lookahead" / name
                if not link.exists():
                    link.symlink_to((tree / name).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))  # (no empty entry)
    argv = [a for a in sys.argv[1:] if a not in ("--baseline", str(args.baseline))]
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(runs: dict) -> list[dict]:
    """Per label and row count: the median over rounds of each round's median host time, and its phases."""
    out = []
    for label, measured in runs.items():
        for i, entry in enumerate(measured[0]["rows"]):
            n = entry["rows"]
            host = statistics.median(m["rows"][i]["host_us"] for m in measured)
            cpu = statistics.median(m["rows"][i]["host_cpu_us"] for m in measured)
            row = {"label": label, "rows": n, "host_us": host, "host_us_per_row": host / n, "host_cpu_us": cpu,
                   "host_cpu_us_per_row": cpu / n,
                   "steps": entry["steps"], "tokens_per_step": entry["tokens_per_step"],
                   "tokens_fed": entry["tokens_fed"]}
            if "phases_us" in entry:
                row["phases_us"] = {k: statistics.median(m["rows"][i]["phases_us"][k] for m in measured)
                                    for k in entry["phases_us"]}
            out.append(row)
    return out


def _print(result: dict) -> None:
    print(f"engine host time per step, {result['machine']['device']}, lookahead {result['config']}, "
          f"{result['tokens']} tokens a request, load {result['load'][0]:.2f}")
    parts = ("draft", "pack", "verify", "commit", "schedule")
    print_table(["code", "rows", "steps", "tokens/step", "host us/step", "us/row/step", "CPU us/row/step",
                 *(f"{p} us/row" for p in parts), "(learn us/row)"],
                [[r["label"], r["rows"], r["steps"], f"{r['tokens_per_step']:.1f}", f"{r['host_us']:.0f}",
                  f"{r['host_us_per_row']:.1f}", f"{r['host_cpu_us_per_row']:.1f}",
                  *(f"{r['phases_us'][p] / r['rows']:.1f}" if "phases_us" in r else "" for p in parts),
                  f"{r['phases_us']['learn'] / r['rows']:.1f}" if "phases_us" in r else ""]
                 for r in result["summary"]])
    labels = [r["label"] for r in result["summary"]]
    if "before" in labels:
        before = {r["rows"]: r["host_us"] for r in result["summary"] if r["label"] == "before"}
        cpu = {r["rows"]: r["host_cpu_us"] for r in result["summary"] if r["label"] == "before"}
        print("after / before, wall (CPU): " + ", ".join(
            f"{r['rows']} rows {r['host_us'] / before[r['rows']]:.2f} ({r['host_cpu_us'] / cpu[r['rows']]:.2f})"
            for r in result["summary"] if r["label"] == "after"))
    for label, measured in result["runs"].items():
        top = measured[-1]["rows"][-1].get("profile_top")
        if top:
            print(f"\n{label}: top functions by own time at {measured[-1]['rows'][-1]['rows']} rows (us per step)")
            print_table(["function", "calls/step", "own us", "cumulative us"],
                        [[p["function"], f"{p['calls_per_step']:.1f}", f"{p['own_us']:.0f}",
                          f"{p['cumulative_us']:.0f}"] for p in top])


if __name__ == "__main__":
    main()
