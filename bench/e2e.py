"""End-to-end: plain greedy, transformers (greedy, prompt lookup) and lookahead at several settings.

All methods run in one process on the same prompts from bench/data/dev.jsonl, interleaved per prompt
(the order rotates from prompt to prompt) so machine noise hits them alike. Prints per-kind tables of
S (tokens / forward passes), tokens/s, the speed ratio against transformers' greedy and the worst prompt's, with
the count of outputs identical to plain greedy, and for self-tuned settings how often each step size was chosen;
saves JSON and two PNGs (per kind; the chosen step sizes).

    python bench/e2e.py --quick          # a minute: 4 prompts, 48 tokens
    python bench/e2e.py --per-kind 2     # 8 prompts, 256 tokens
    python bench/e2e.py --configs 3-4-3 3-4-3:chains 1-2-8   # settings as in bench/compression.py
    python bench/e2e.py --configs 1-4-5 1-4-5@auto --quickstart --busy 3   # beside 3 busy processes

A setting with "@auto" sizes its steps by the measured cost model (the default `LookaheadConfig()` is 1-4-5@auto);
"@auto/always" runs its self-tuned steps with the lookahead branch, "@auto/never" without it (a CPU's default), for
the branch measurement of docs/results.md.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import subprocess
import sys
import time

import torch
from compression import parse_setting

from common import RESULTS, chat_ids, cold, device_slug, load_model, load_prompts, machine, print_table, save_json, sync

REQUIRED = ["15-5-15", "7-5-7", "5-3-5"]
QUICKSTART = "Explain what a hash table is in two sentences."  # README's Quickstart prompt
BUSY = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\n"
        "while True:\n    a = torch.tanh(a @ a)")  # one competing process: a core's worth of matrix products
CPU_CANDIDATES = ["2-3-2", "3-3-3", "4-3-4", "3-4-3", "5-4-5", "3-4-3:chains"]


def make_methods(model, hf, configs, max_new_tokens: int):
    """name -> fn(prompt_ids) -> (tokens, forward passes, step sizes or None)."""
    calls = {"n": 0}
    hf.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    eos = list(model.config.eos_token_id)

    def ours(lookahead, branch=None):
        from lookahead.tuning import budget

        def run(ids):
            policy = budget.BRANCH
            budget.BRANCH = branch or policy
            cold(model)  # its whole prompt prefilled, as transformers' methods do
            try:
                result = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=lookahead)
            finally:
                budget.BRANCH = policy
            return result.tokens, result.steps, result.step_sizes
        return run

    def transformers(**kwargs):
        def run(ids):
            calls["n"] = 0
            inputs = torch.tensor([ids], device=model.device)
            out = hf.generate(inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0], **kwargs)
            return out[0, len(ids):].tolist(), calls["n"], None
        return run

    methods = {"greedy (ours)": ours(None), "hf greedy": transformers(),
               "hf prompt lookup": transformers(prompt_lookup_num_tokens=10)}
    for spec in configs:
        setting, _, branch = spec.partition("/")
        methods[f"lookahead {spec}"] = ours(parse_setting(setting), branch or None)
    return methods


def start_busy(count: int) -> None:
    """`count` competing processes, each a core's worth of work, stopped when this one exits."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
    atexit.register(lambda: [p.kill() for p in procs])
    time.sleep(2.0)  # running before the first timing


def run(args) -> dict:
    from transformers import LlamaForCausalLM

    folder, model, tokenizer = load_model(args.model)
    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(model.device).eval()
    configs = args.configs or REQUIRED + CPU_CANDIDATES
    methods = make_methods(model, hf, configs, args.max_new_tokens)
    prompts = load_prompts(args.per_kind)
    if args.quickstart:
        prompts.append({"id": "quickstart", "kind": "quickstart", "prompt": QUICKSTART})
    records = []
    if args.busy:
        start_busy(args.busy)
    with torch.inference_mode():
        model.warmup(parse_setting("1-4-5@auto"), max_tokens=2048)  # the cost model, measured here if not cached
        methods["greedy (ours)"](chat_ids(tokenizer, "Hello"))  # warm-up
        for p, row in enumerate(prompts):
            ids = chat_ids(tokenizer, row["prompt"])
            names = list(methods)
            names = names[p % len(names):] + names[: p % len(names)]
            outputs = {}
            for name in names:
                sync()
                start = time.perf_counter()
                tokens, steps, sizes = methods[name](ids)
                sync()
                outputs[name] = (tokens, steps, time.perf_counter() - start, sizes)
            reference = outputs["greedy (ours)"][0]
            for name, (tokens, steps, seconds, sizes) in outputs.items():
                records.append({"id": row["id"], "kind": row["kind"], "method": name, "tokens": len(tokens),
                                "steps": steps, "seconds": seconds, "exact": tokens == reference,
                                "step_sizes": dict(collections.Counter(sizes or []))})
            print(f"[{p + 1}/{len(prompts)}] {row['id']}: " + ", ".join(
                f"{n} S={outputs[n][0].__len__() / outputs[n][1]:.2f}" for n in methods if n.startswith("look")),
                flush=True)
    return {"machine": machine(), "max_new_tokens": args.max_new_tokens, "methods": list(methods),
            "busy_processes": args.busy, "cold_prefill": True, "records": records}


def summarize(result: dict) -> dict:
    """{kind or 'all': {method: {S, tok_s, ratio, exact, n}}}; S and tokens/s are ratios of sums."""
    kinds = sorted({r["kind"] for r in result["records"]}) + ["all"]
    table = {}
    for kind in kinds:
        rows = [r for r in result["records"] if kind == "all" or r["kind"] == kind]
        per = {}
        for name in result["methods"]:
            mine = [r for r in rows if r["method"] == name]
            tokens = sum(r["tokens"] for r in mine)
            per[name] = {"S": tokens / sum(r["steps"] for r in mine), "tok_s": tokens / sum(r["seconds"] for r in mine),
                         "exact": sum(r["exact"] for r in mine), "n": len(mine)}
        base, ours = per["hf greedy"]["tok_s"], per["greedy (ours)"]["tok_s"]
        seconds = {(r["id"], r["method"]): r["seconds"] for r in rows}
        for name, stats in per.items():
            stats["ratio"] = stats["tok_s"] / base
            stats["vs_greedy"] = stats["tok_s"] / ours
            # the worst prompt: its time against transformers' greedy and against ours (same tokens, so time ratios)
            ids = {r["id"] for r in rows}
            stats["worst_ratio"] = min(seconds[(i, "hf greedy")] / seconds[(i, name)] for i in ids)
            stats["worst_vs_greedy"] = min(seconds[(i, "greedy (ours)")] / seconds[(i, name)] for i in ids)
        table[kind] = per
    return table


def step_size_histograms(result: dict) -> dict:
    """{method: {step size: steps}} over every prompt, for the methods that report their step sizes."""
    out: dict = {}
    for r in result["records"]:
        if r["step_sizes"] and r["method"] != "greedy (ours)":
            sizes = out.setdefault(r["method"], collections.Counter())
            sizes.update({int(k): v for k, v in r["step_sizes"].items()})
    return {name: dict(sorted(sizes.items())) for name, sizes in out.items()}


def plot_step_sizes(histograms: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(len(histograms), 1)
    for m, (name, sizes) in enumerate(histograms.items()):
        total = sum(sizes.values())
        ax.bar([s + m * width for s in sizes], [c / total for c in sizes.values()], width, label=name)
    ax.set_xlabel("tokens fed by a step")
    ax.set_ylabel("share of steps")
    ax.set_title("step sizes chosen")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(table: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(table)
    methods = list(table["all"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.4))
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab20").colors
    for m, name in enumerate(methods):
        xs = [k + m * width for k in range(len(kinds))]
        axes[0].bar(xs, [table[k][name]["S"] for k in kinds], width, label=name, color=colors[m % 20])
        axes[1].bar(xs, [table[k][name]["ratio"] for k in kinds], width, label=name, color=colors[m % 20])
    for ax, title in zip(axes, ("compression S (tokens / forward passes)", "tokens/s relative to HF greedy"),
                         strict=True):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.8)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=2, help="prompts of each kind (0: all 35)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--configs", nargs="*", help="lookahead settings as W-N-G[:chains|:tree=sources] "
                        "(default: required + CPU set)")
    parser.add_argument("--quick", action="store_true", help="1 prompt per kind, 48 tokens, 3 configs")
    parser.add_argument("--quickstart", action="store_true", help="also README's Quickstart prompt (its own kind)")
    parser.add_argument("--busy", type=int, default=0, help="run beside this many competing busy processes")
    parser.add_argument("--name", default="e2e", help="results file stem")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the saved JSON")
    args = parser.parse_args()
    if args.quick:
        args.per_kind, args.max_new_tokens = 1, 48
        args.configs = args.configs or ["7-5-7", "3-3-3", "5-4-5"]
    args.per_kind = args.per_kind or None
    if args.replot:
        path = RESULTS / f"{args.name}-{device_slug()}.json"
        plot(json.loads(path.read_text())["summary"], path.with_suffix(".png"))
        return
    result = run(args)
    table = summarize(result)
    result["summary"] = table
    result["step_sizes"] = step_size_histograms(result)
    busy = f", beside {args.busy} busy processes" if args.busy else ""
    for kind, per in table.items():
        print(f"\n{kind} ({per['greedy (ours)']['n']} prompts, {result['machine']['device']}{busy})")
        print_table(["method", "S", "tokens/s", "vs HF greedy", "worst prompt", "vs greedy (ours)", "worst", "exact"],
                    [[n, f"{s['S']:.2f}", f"{s['tok_s']:.1f}", f"{s['ratio']:.2f}x", f"{s['worst_ratio']:.2f}x",
                      f"{s['vs_greedy']:.2f}x", f"{s['worst_vs_greedy']:.2f}x", f"{s['exact']}/{s['n']}"]
                     for n, s in per.items()])
    for name, sizes in result["step_sizes"].items():
        print(f"{name}: step sizes {sizes}")
    path = save_json(args.name, result)
    plot(table, path.with_suffix(".png"))
    sizes_png = path.with_name(path.stem + "-sizes.png")
    plot_step_sizes(result["step_sizes"], sizes_png)
    print(f"\nsaved {path}, {path.with_suffix('.png')} and {sizes_png}")


if __name__ == "__main__":
    main()
