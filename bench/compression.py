"""Compression S per kind for chosen (W, N, G) on the dev prompts, counting forward passes only.

Every output is checked token for token against plain greedy. `--pools prompt` runs the authors' setting
(prompt n-grams only in the pool); `--pools both` runs it beside ours.

    python bench/compression.py --kinds chat code math --per-kind 3 --configs 15-5-15 7-5-7 5-4-5 3-3-3 --pools both
"""

from __future__ import annotations

import argparse

import torch

from common import chat_ids, load_model, load_prompts, machine, print_table, save_json
from lookahead import LookaheadConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--kinds", nargs="*", default=["chat", "code", "math", "summarize"])
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--configs", nargs="*", default=["15-5-15", "7-5-7", "5-4-5", "3-3-3"])
    parser.add_argument("--pools", choices=("ours", "prompt", "both"), default="ours",
                        help="ours: prompt + output n-grams; prompt: prompt n-grams only (the authors'); both")
    parser.add_argument("--name", default="compression")
    args = parser.parse_args()
    folder, model, tokenizer = load_model(args.model)
    rows = load_prompts(args.per_kind, tuple(args.kinds))
    pools = {"ours": [True], "prompt": [False], "both": [True, False]}[args.pools]
    variants = [(spec, output_pool) for output_pool in pools for spec in args.configs]
    records = []
    with torch.inference_mode():
        for row in rows:
            ids = chat_ids(tokenizer, row["prompt"])
            reference = model.generate(ids, max_new_tokens=args.max_new_tokens).tokens
            for spec, output_pool in variants:
                cfg = LookaheadConfig(*map(int, spec.split("-")), pool_from_output=output_pool)
                result = model.generate(ids, max_new_tokens=args.max_new_tokens, lookahead=cfg)
                records.append({"id": row["id"], "kind": row["kind"], "config": spec, "output_pool": output_pool,
                                "tokens": len(result.tokens), "steps": result.steps,
                                "exact": result.tokens == reference})
            print(f"{row['id']} done", flush=True)
    kinds = list(dict.fromkeys(r["kind"] for r in records)) + ["all"]
    table = []
    for spec, output_pool in variants:
        mine = [r for r in records if r["config"] == spec and r["output_pool"] == output_pool]
        line = [spec + ("" if output_pool else " (prompt pool only)")]
        for kind in kinds:
            part = [r for r in mine if kind == "all" or r["kind"] == kind]
            line.append(f"{sum(r['tokens'] for r in part) / sum(r['steps'] for r in part):.2f}")
        line.append(f"{sum(r['exact'] for r in mine)}/{len(mine)}")
        table.append(line)
    print(f"\nS by kind ({len(rows)} prompts, {args.max_new_tokens} tokens, {machine()['device']})")
    print_table(["W-N-G"] + kinds + ["exact"], table)
    print(save_json(args.name, {"machine": machine(), "max_new_tokens": args.max_new_tokens, "records": records,
                                "table": table}))


if __name__ == "__main__":
    main()
