"""Batch size against tokens/s and S: plain and lookahead decoding side by side, in one run.

For each batch size b the same prompts from bench/data/dev.jsonl are decoded in batches of b (in file
order) by plain decoding and by lookahead decoding at each configuration, the methods interleaved per
batch (the order rotates from batch to batch) so machine noise hits them alike. Reports per (b, method):
S (tokens / the forward passes each row took part in, prefill included), tokens/s (all rows' tokens /
wall time), the ratio to plain decoding at the same b, and the count of rows identical to plain greedy
alone. Batch size 1 also runs the one-prompt path (`generate(ids)`, exact-size steps on a CPU).

A side measurement decides the batch loop's prefill: one row at a time against one padded forward pass of all
rows (`prefill`). (Finished rows dropped from the batch against kept as padding was measured before, the
`drop` records of bench/results/batch-cpu.json; the library keeps only the faster rule.) Saves JSON and a PNG in
bench/results/.

    python bench/batch.py --quick              # a few minutes: 4 prompts, 32 tokens, b = 1, 2, 4
    python bench/batch.py                      # 16 prompts, 128 tokens, b = 1, 2, 4, 8, 16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    chat_ids,
    cold,
    device_slug,
    load_model,
    load_prompts,
    machine,
    print_table,
    save_json,
    timed,
)
from lookahead import LookaheadConfig  # noqa: E402

PLAIN = "plain"


def decode_rows(model, prompts, max_new_tokens, lookahead):
    """A batch through `Llama.generate` (a list of prompts)."""
    return model.generate(prompts, max_new_tokens=max_new_tokens, lookahead=lookahead)


def run_sizes(model, prompts, references, sizes, configs, max_new_tokens) -> list[dict]:
    methods = {PLAIN: None, **{f"lookahead {w}-{n}-{g}": LookaheadConfig(w, n, g) for w, n, g in configs}}
    records = []
    for b in sizes:
        batches = [list(range(i, min(i + b, len(prompts)))) for i in range(0, len(prompts), b)]
        for k, rows in enumerate(batches):
            names = list(methods)
            names = names[k % len(names):] + names[: k % len(names)]
            if b == 1:
                names.append("one-prompt path")
            for name in names:
                cold(model)  # a batch of one would resume the prompt the method before it prefilled
                if name == "one-prompt path":
                    cfg = LookaheadConfig(*configs[0])
                    result, seconds = timed(lambda: [model.generate(prompts[rows[0]], max_new_tokens=max_new_tokens,  # noqa: B023
                                                                    lookahead=cfg)])  # noqa: B023
                else:
                    result, seconds = timed(lambda: decode_rows(model, [prompts[i] for i in rows],  # noqa: B023
                                                                max_new_tokens, methods[name]))  # noqa: B023
                records.append({"batch": b, "method": name, "rows": rows, "seconds": seconds,
                                "tokens": [len(r.tokens) for r in result], "steps": [r.steps for r in result],
                                "exact": sum(r.tokens == references[i] for r, i in zip(result, rows, strict=True))})
            done = [r for r in records if r["batch"] == b and r["rows"] == rows]
            print(f"b={b} rows {rows[0]}..{rows[-1]}: " + ", ".join(
                f"{r['method']} {sum(r['tokens']) / r['seconds']:.1f} tok/s" for r in done), flush=True)
    return records


def prefill_costs(model, prompts, sizes, repeats: int = 3) -> list[dict]:
    """Per batch: the forward passes of a prefill one row at a time against one right-padded pass of all rows
    (causal attention needs no mask for right padding); the rows' compute is the same model either way."""
    out = []
    for b in sizes:
        if b == 1:
            continue
        for i in range(0, len(prompts) - b + 1, b):
            rows = prompts[i : i + b]
            width = max(map(len, rows))
            padded = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=model.device)
            singles = [torch.tensor([r], device=model.device) for r in rows]
            per_row = min(timed(lambda: [model(x) for x in singles])[1] for _ in range(repeats))  # noqa: B023
            batched = min(timed(lambda: model(padded))[1] for _ in range(repeats))  # noqa: B023
            out.append({"batch": b, "tokens": sum(map(len, rows)), "padded_tokens": b * width,
                        "per_row_s": per_row, "padded_s": batched})
    return out


def summarize(result: dict) -> list[dict]:
    """Per (b, method): S, tokens/s and the ratio to plain at the same b (ratios of sums)."""
    table = []
    for b in result["sizes"]:
        mine = [r for r in result["records"] if r["batch"] == b]
        per = {}
        for name in dict.fromkeys(r["method"] for r in mine):
            rs = [r for r in mine if r["method"] == name]
            tokens = sum(sum(r["tokens"]) for r in rs)
            per[name] = {"S": tokens / sum(sum(r["steps"]) for r in rs),
                         "tok_s": tokens / sum(r["seconds"] for r in rs),
                         "exact": sum(r["exact"] for r in rs), "n": sum(len(r["rows"]) for r in rs)}
        for name, stats in per.items():
            table.append({"batch": b, "method": name, **stats, "vs_plain": stats["tok_s"] / per[PLAIN]["tok_s"]})
    return table


def plot(table: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    panels = (("tok_s", "tokens/s (all rows; absolute figures drift with the shared CPU's load)"),
              ("vs_plain", "tokens/s / plain's at the same b (interleaved)"),
              ("S", "S (tokens / forward passes, per row)"))
    for name in dict.fromkeys(r["method"] for r in table):
        rows = [r for r in table if r["method"] == name]
        style = dict(marker="o") if len(rows) > 1 else dict(marker="*", markersize=12, linestyle="none")
        for ax, (key, _) in zip(axes, panels, strict=True):
            ax.plot([r["batch"] for r in rows], [r[key] for r in rows], label=name, **style)
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=4, help="prompts of each kind")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--configs", nargs="*", default=["3-4-3", "2-3-2"], help="lookahead configs as W-N-G")
    parser.add_argument("--quick", action="store_true", help="1 prompt per kind, 32 tokens, b = 1, 2, 4")
    parser.add_argument("--name", default="batch", help="results file stem")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the saved JSON")
    args = parser.parse_args()
    if args.quick:
        args.per_kind, args.max_new_tokens, args.sizes = 1, 32, [1, 2, 4]
    if args.replot:
        path = RESULTS / f"{args.name}-{device_slug()}.json"
        plot(json.loads(path.read_text())["summary"], path.with_suffix(".png"))
        return
    configs = [tuple(map(int, c.split("-"))) for c in args.configs]
    _, model, tokenizer = load_model(args.model)
    prompts = [chat_ids(tokenizer, row["prompt"]) for row in load_prompts(args.per_kind)]
    with torch.inference_mode():
        model.generate(prompts[0], max_new_tokens=4)  # warm-up
        references = [model.generate(ids, max_new_tokens=args.max_new_tokens).tokens for ids in prompts]
        records = run_sizes(model, prompts, references, args.sizes, configs, args.max_new_tokens)
        prefill = prefill_costs(model, prompts, args.sizes)
    result = {"machine": machine(), "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "sizes": args.sizes, "configs": args.configs, "records": records, "prefill": prefill}
    result["summary"] = table = summarize(result)
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, {result['machine']['device']}, "
          f"{result['machine']['cpu_threads']} threads")
    print_table(["batch", "method", "S", "tokens/s", "vs plain (same b)", "exact"],
                [[r["batch"], r["method"], f"{r['S']:.2f}", f"{r['tok_s']:.1f}", f"{r['vs_plain']:.2f}x",
                  f"{r['exact']}/{r['n']}"] for r in table])
    if prefill:
        print("\nprefill: one row at a time vs one right-padded forward of all rows")
        print_table(["batch", "tokens", "padded tokens", "per row s", "padded s"],
                    [[b, sum(p["tokens"] for p in prefill if p["batch"] == b),
                      sum(p["padded_tokens"] for p in prefill if p["batch"] == b),
                      f"{sum(p['per_row_s'] for p in prefill if p['batch'] == b):.2f}",
                      f"{sum(p['padded_s'] for p in prefill if p['batch'] == b):.2f}"]
                     for b in dict.fromkeys(p["batch"] for p in prefill)])
    path = save_json(args.name, result)
    plot(table, path.with_suffix(".png"))
    print(f"\nsaved {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
