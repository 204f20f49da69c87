"""Warm drafting and the conversation's cache: what a model that serves many requests gains from keeping them.

(a) stream: the dev prompts one after another on one model, warm (drafting from the memory earlier prompts left)
    against cold (`warm=False`, each prompt as if alone), per kind: S and tokens/s;
(b) conversations: the 10 two-turn chats of bench/data/dev-turn2.jsonl; turn 2 on the model that ran turn 1 (its
    cache reused, warm drafts, memory from earlier conversations too) against a fresh model (no cache history, no
    memory): S, wall time and time to first token;
(c) repetitive: one instruction over different inputs (the code prompts, then the summarisation prompts), each
    kind a stream of its own from an empty memory, warm; cold is (a)'s (a cold generation depends on its prompt only).
Warm and cold tokens are compared (greedy: they must be equal). Timings share the machine with whatever else runs;
S does not depend on load. Every generation uses `budget="fixed"`.

    python bench/warm.py --quick     # a few minutes: 2 prompts per kind, 64 tokens
    python bench/warm.py             # all 35 prompts, 10 conversations, 256 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from compression import parse_setting

from common import DATA, chat_ids, load_model, load_prompts, machine, print_table, save_json

TURNS = DATA.parent / "dev-turn2.jsonl"  # sources and licenses: bench/data/README.md


def generate(model, ids, config, max_new_tokens: int) -> dict:
    """One generation's record: tokens, steps, seconds, time to first token, positions reused from the cache."""
    first: list[float] = []
    start = time.perf_counter()
    result = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=config,
                            stream=lambda _: first or first.append(time.perf_counter()))
    seconds = time.perf_counter() - start
    return {"tokens": len(result.tokens), "steps": result.steps, "seconds": seconds, "ttft": first[0] - start,
            "reused": result.cached_tokens, "ids": result.tokens}


def held(model) -> dict:
    memory = model.draft_memory
    return {"generations": memory.generations, "tokens_held": memory.tokens_held, "bytes_held": memory.bytes_held,
            "cap_tokens": memory.cap_tokens}


def stream(models, tokenizer, rows, warm, cold, max_new_tokens) -> list[dict]:
    """(a): each prompt warm on one model and cold on the other, in alternating order (noise hits both alike)."""
    records = []
    for p, row in enumerate(rows):
        ids = chat_ids(tokenizer, row["prompt"])
        runs = [("warm", models["warm"], warm), ("cold", models["cold"], cold)]
        out = {name: generate(model, ids, config, max_new_tokens) for name, model, config in runs[:: 1 - 2 * (p % 2)]}
        for name, record in out.items():
            records.append({"id": row["id"], "kind": row["kind"], "mode": name, **record,
                            "exact": record["ids"] == out["cold"]["ids"]})
        print(f"[{p + 1}/{len(rows)}] {row['id']}: S warm {ratio(out['warm'])} cold {ratio(out['cold'])}", flush=True)
    return records


def conversations(models, tokenizer, rows, warm, cold, max_new_tokens) -> list[dict]:
    """(b): turn 1 then turn 2 on the served model; turn 2 again on a fresh one."""
    served, fresh = models["warm"], models["cold"]
    records = []
    for c, row in enumerate(rows):
        first, second = row["turns"]
        turn1 = generate(served, chat_ids(tokenizer, first), warm, max_new_tokens)
        messages = [{"role": "user", "content": first},
                    {"role": "assistant", "content": tokenizer.decode(turn1["ids"], skip_special_tokens=True)},
                    {"role": "user", "content": second}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        resumed = generate(served, ids, warm, max_new_tokens)
        fresh.release()  # no cache history, no drafting memory: what a model loaded for this turn has
        fresh.draft_memory.clear()
        fresh.generate([0], max_new_tokens=1)  # (the runner built, so its building is not counted below)
        alone = generate(fresh, ids, cold, max_new_tokens)
        for mode, record in (("reuse + warm", resumed), ("fresh", alone)):
            records.append({"id": row["id"], "mode": mode, "prompt": len(ids), **record,
                            "exact": record["ids"] == alone["ids"]})
        print(f"[{c + 1}/{len(rows)}] {row['id']}: turn 2 of {len(ids)} tokens, {resumed['reused']} reused; "
              f"TTFT {resumed['ttft'] * 1e3:.0f} ms vs {alone['ttft'] * 1e3:.0f} ms; S {ratio(resumed)} vs "
              f"{ratio(alone)}", flush=True)
    return records


def repetitive(model, tokenizer, rows, warm, max_new_tokens) -> list[dict]:
    """(c): per kind, its prompts in a stream from an empty memory."""
    records = []
    for kind in dict.fromkeys(row["kind"] for row in rows):
        model.draft_memory.clear()
        for row in (r for r in rows if r["kind"] == kind):
            record = generate(model, chat_ids(tokenizer, row["prompt"]), warm, max_new_tokens)
            records.append({"id": row["id"], "kind": kind, "mode": "warm", **record})
            print(f"{row['id']}: S warm {ratio(record)}", flush=True)
        records[-1]["held"] = held(model)
    return records


def ratio(record) -> str:
    return f"{record['tokens'] / record['steps']:.2f}"


def totals(records) -> dict:
    tokens = sum(r["tokens"] for r in records)
    return {"S": tokens / sum(r["steps"] for r in records), "tok_s": tokens / sum(r["seconds"] for r in records),
            "ttft": sum(r["ttft"] for r in records) / len(records), "n": len(records),
            "exact": sum(r.get("exact", True) for r in records)}


def summarize(result: dict) -> dict:
    """{part: {group: {mode: totals}}}: (a) and (c) by kind and all; (b) over the conversations."""
    summary: dict = {}
    repeated = {r["kind"] for r in result["repetitive"]}
    cold = [r for r in result["stream"] if r["mode"] == "cold" and r["kind"] in repeated]
    for part, records in (("stream", result["stream"]), ("repetitive", result["repetitive"] + cold)):
        kinds = list(dict.fromkeys(r["kind"] for r in records))
        summary[part] = {kind: {mode: totals([r for r in records if r["mode"] == mode and kind in ("all", r["kind"])])
                                for mode in ("warm", "cold")}
                         for kind in kinds + ["all"]}
    summary["conversations"] = {mode: totals([r for r in result["conversations"] if r["mode"] == mode])
                                for mode in ("reuse + warm", "fresh")}
    return summary


def report(result: dict) -> None:
    summary, device = result["summary"], result["machine"]["device"]
    for part, title in (("stream", "(a) the dev prompts in a stream"), ("repetitive", "(c) one instruction, many "
                                                                                       "inputs (cold: (a)'s)")):
        print(f"\n{title}: {result['max_new_tokens']} tokens, {device}")
        print_table(["kind", "S warm", "S cold", "gain", "tok/s warm", "tok/s cold", "warm = cold tokens"],
                    [[kind, f"{s['warm']['S']:.2f}", f"{s['cold']['S']:.2f}", f"{s['warm']['S'] - s['cold']['S']:+.2f}",
                      f"{s['warm']['tok_s']:.1f}", f"{s['cold']['tok_s']:.1f}",
                      f"{s['warm']['exact']}/{s['warm']['n']}"] for kind, s in summary[part].items()])
    conv = summary["conversations"]
    print(f"\n(b) turn 2 of {conv['fresh']['n']} conversations: served model (cache reused, warm drafts) against a "
          "fresh one")
    print_table(["model", "S", "tok/s", "time to first token (ms)", "same tokens"],
                [[mode, f"{s['S']:.2f}", f"{s['tok_s']:.1f}", f"{s['ttft'] * 1e3:.0f}", f"{s['exact']}/{s['n']}"]
                 for mode, s in conv.items()])
    print(f"time to first token: {conv['fresh']['ttft'] / conv['reuse + warm']['ttft']:.1f}x lower with reuse")
    print(f"memory held after (a): {result['held']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=0, help="prompts of each kind (0: all)")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--config", default="1-4-5", help="W-N-G[:tree=sources] as in bench/compression.py")
    parser.add_argument("--quick", action="store_true", help="2 prompts per kind, 2 conversations, 64 tokens")
    parser.add_argument("--name", default="warm", help="results file stem")
    args = parser.parse_args()
    if args.quick:
        args.per_kind, args.conversations, args.max_new_tokens = 2, 2, 64
    cold = dataclasses.replace(parse_setting(args.config), budget="fixed")
    warm = dataclasses.replace(cold, warm=True)
    _, model, tokenizer = load_model(args.model)
    _, other, _ = load_model(args.model)
    models = {"warm": model, "cold": other}
    rows = load_prompts(args.per_kind or None)
    turns = [json.loads(line) for line in TURNS.read_text(encoding="utf-8").splitlines() if line.strip()]
    with torch.inference_mode():
        for m in models.values():
            m.generate(chat_ids(tokenizer, "Hello"), max_new_tokens=8)  # warm-up (plain: no drafts remembered)
        result = {"machine": machine(), "max_new_tokens": args.max_new_tokens, "config": args.config,
                  "stream": stream(models, tokenizer, rows, warm, cold, args.max_new_tokens)}
        result["held"] = held(model)
        result["conversations"] = conversations(models, tokenizer, turns[: args.conversations], warm, cold,
                                                args.max_new_tokens)
        result["held_after_conversations"] = held(model)
        result["repetitive"] = repetitive(model, tokenizer, [r for r in rows if r["kind"] in ("code", "summarize")],
                                          warm, args.max_new_tokens)
    for part in ("stream", "conversations", "repetitive"):
        for record in result[part]:
            del record["ids"]
    result["summary"] = summarize(result)
    report(result)
    print(save_json(args.name, result))


if __name__ == "__main__":
    main()
