"""Compression S per kind for chosen settings on the dev prompts, counting forward passes only.

A setting is W-N-G, then optionally ":chains" (the paper's candidates), ":tree" (every draft source, the
default) or ":tree=" with the sources that feed the tree joined by "+" (pool, suffix, recycle; none: ""), then
optionally "@auto" (self-tuned steps; without it every step is full-size, `budget="fixed"`, as the paper's).
Every setting drafts cold (`warm=False`): from its own prompt and output only.
Every output is checked token for token against plain greedy. `--pools prompt` runs the authors' pool
(prompt n-grams only); `--pools both` runs it beside ours.

    python bench/compression.py --per-kind 0 --configs 3-4-3 3-4-3:chains 15-5-15 15-5-15:chains
    python bench/compression.py --configs 3-4-3:tree=pool 3-4-3:tree=suffix 3-4-3:tree=recycle
    python bench/compression.py --second-turns --configs 1-4-5   # turn 2 of the two-turn dev conversations

With `--second-turns` the prompts are the second turns of bench/data/dev-turn2.jsonl (10 conversations: "rewrite
your answer ...", much of it copied), each after its first turn's plain greedy answer, instead of dev.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import DATA, chat_ids, greedy_reference, load_model, load_prompts, machine, print_table, save_json
from lookahead import LookaheadConfig

SOURCES = ("pool", "suffix", "recycle")


def parse_setting(spec: str, output_pool: bool = True) -> LookaheadConfig:
    """'W-N-G[:chains|:tree[=source+source...]][@auto]' -> LookaheadConfig."""
    spec, _, budget = spec.partition("@")
    if budget not in ("", "auto"):
        raise ValueError(f"setting {spec}@{budget}: the only budget suffix is @auto")
    numbers, _, form = spec.partition(":")
    w, n, g = map(int, numbers.split("-"))
    form, has_sources, sources = form.partition("=")
    form = form or "tree"
    chosen = set(sources.split("+")) - {""} if has_sources else set(SOURCES)
    if form not in ("tree", "chains") or chosen - set(SOURCES):
        raise ValueError(f"setting {spec!r}: use W-N-G, W-N-G:chains or W-N-G:tree=pool+suffix+recycle")
    # warm=False: each prompt drafts from itself alone, as a one-prompt benchmark compares (bench/warm.py: warm)
    return LookaheadConfig(w, n, g, pool_from_output=output_pool, form=form, budget=budget or "fixed", warm=False,
                           **{f"draft_{name}": name in chosen for name in SOURCES})


def second_turns(model, folder, tokenizer, max_new_tokens: int) -> list[dict]:
    """Rows {id, kind, ids} of the two-turn conversations' second turns, after each first turn's greedy answer."""
    rows = []
    for line in (DATA.parent / "dev-turn2.jsonl").read_text(encoding="utf-8").splitlines():
        conversation = json.loads(line)
        first, second = conversation["turns"]
        answer = greedy_reference(model, folder, chat_ids(tokenizer, first), max_new_tokens)
        messages = [{"role": "user", "content": first},
                    {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                    {"role": "user", "content": second}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rows.append({"id": conversation["id"], "kind": conversation["kind"],
                     "ids": list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--kinds", nargs="*", default=["chat", "code", "math", "summarize"])
    parser.add_argument("--per-kind", type=int, default=2, help="prompts of each kind (0: all)")
    parser.add_argument("--skip", type=int, default=0, help="skip each kind's first prompts (those a fit saw)")
    parser.add_argument("--second-turns", action="store_true", help="the two-turn conversations' second turns")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--configs", nargs="*", default=["3-4-3", "3-4-3:chains", "15-5-15", "15-5-15:chains"])
    parser.add_argument("--pools", choices=("ours", "prompt", "both"), default="ours",
                        help="ours: prompt + output n-grams; prompt: prompt n-grams only (the authors'); both")
    parser.add_argument("--static", action="store_true", help="static steps (one shape per generation)")
    parser.add_argument("--name", default="compression")
    args = parser.parse_args()
    folder, model, tokenizer = load_model(args.model)
    if args.second_turns:
        rows = second_turns(model, folder, tokenizer, args.max_new_tokens)
    else:
        rows = [{**row, "ids": chat_ids(tokenizer, row["prompt"])}
                for row in load_prompts(args.per_kind or None, tuple(args.kinds), args.skip)]
    pools = {"ours": [True], "prompt": [False], "both": [True, False]}[args.pools]
    variants = [(spec, output_pool) for output_pool in pools for spec in args.configs]
    records = []
    with torch.inference_mode():
        for row in rows:
            ids = row["ids"]
            reference = greedy_reference(model, folder, ids, args.max_new_tokens)
            for spec, output_pool in variants:
                start = time.perf_counter()
                result = model.generate(ids, max_new_tokens=args.max_new_tokens, static_step=args.static,
                                        lookahead=parse_setting(spec, output_pool))
                records.append({"id": row["id"], "kind": row["kind"], "config": spec, "output_pool": output_pool,
                                "tokens": len(result.tokens), "steps": result.steps,
                                "seconds": time.perf_counter() - start, "exact": result.tokens == reference})
            mine = records[-len(variants) :]
            print(f"{row['id']}: " + ", ".join(f"{r['config']} {r['tokens'] / r['steps']:.2f}" for r in mine),
                  flush=True)
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
    print_table(["setting"] + kinds + ["exact"], table)
    print(save_json(args.name, {"machine": machine(), "max_new_tokens": args.max_new_tokens, "records": records,
                                "table": table}))


if __name__ == "__main__":
    main()
