"""Structured outputs on the default model: plain constrained decoding against constrained lookahead without and with
the grammar's forced tokens as drafts, on the schema-shaped prompts of bench/data/structured.json (extraction,
classification with enums, tool calls).

Each prompt runs the three ways back to back (interleaved, so a shared machine's load falls on all three alike), greedy,
through one engine (`engine_for`, its measured cost model sizing the lookahead steps; cold drafting, so no run learns
from another). Reported: S (tokens per forward pass), tokens/s, and how many answers equal plain constrained
decoding's token for token. Saves bench/results/structured-cpu.json and prints a table.

    python bench/structured.py [--quick] [--repeat 2] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common import chat_ids, machine, save_json  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "structured.json"
MODES = ("plain", "lookahead", "lookahead+forced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 prompts, 24 tokens, 1 repeat, not saved")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each prompt and mode (timings: the best)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from lookahead import LookaheadConfig, Request, SamplingParams
    from lookahead.models import Llama, engine_for
    from lookahead.models.default_model import default_model_dir
    from lookahead.structured import Grammars

    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Llama.from_pretrained(folder, dtype="float32")  # the figures' dtype, whatever the CPU
    engine = engine_for(model, max_batch=1, warm=False)
    cfg = dataclasses.replace(LookaheadConfig.auto(model.device.type), warm=False)
    eos = frozenset(model.config.eos_token_id)
    grammars = Grammars(tokenizer, model.config.vocab_size, eos)
    cases = json.loads(DATA.read_text(encoding="utf-8"))["prompts"]
    limit, repeat = args.max_new_tokens, args.repeat
    if args.quick:
        cases, limit, repeat = cases[::4], 24, 1

    def run(case, mode):
        prompt = chat_ids(tokenizer, case["prompt"] + " Answer in JSON.")
        grammar = grammars.json_schema(case["schema"], forced_drafts=mode == "lookahead+forced")
        request = Request([prompt], limit, SamplingParams(), None if mode == "plain" else cfg, eos)
        start = time.perf_counter()
        handle = engine.submit(request, grammar=grammar)
        while engine.step():
            pass
        result = handle.result()
        return result, time.perf_counter() - start, grammar.seconds

    run(cases[0], "plain")  # warm-up
    rows = []
    for case in cases:
        best: dict[str, tuple] = {}
        for _ in range(repeat):
            for mode in MODES:
                result, seconds, grammar_s = run(case, mode)
                if mode not in best or seconds < best[mode][1]:
                    best[mode] = (result, seconds, grammar_s)
        plain = best["plain"][0].tokens
        for mode in MODES:
            result, seconds, grammar_s = best[mode]
            rows.append({"prompt": case["name"], "kind": case["kind"], "mode": mode, "tokens": len(result.tokens),
                         "steps": result.steps, "S": result.compression, "seconds": seconds,
                         "tokens_per_s": len(result.tokens) / seconds, "grammar_s": grammar_s,
                         "exact": result.tokens == plain,
                         "valid": _parses(tokenizer.decode(result.tokens, skip_special_tokens=True))})
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        tokens, steps, seconds = (sum(r[k] for r in mine) for k in ("tokens", "steps", "seconds"))
        summary[mode] = {"S": tokens / steps, "tokens_per_s": tokens / seconds,
                         "grammar_ms_per_token": 1e3 * sum(r["grammar_s"] for r in mine) / tokens,
                         "exact": sum(r["exact"] for r in mine), "valid": sum(r["valid"] for r in mine),
                         "prompts": len(mine)}
    base = summary["plain"]["tokens_per_s"]
    print(f"{'mode':18} {'S':>5} {'tok/s':>7} {'vs plain':>8} {'grammar ms/tok':>14} {'exact':>6} {'valid':>6}")
    for mode, s in summary.items():
        print(f"{mode:18} {s['S']:5.2f} {s['tokens_per_s']:7.1f} {s['tokens_per_s'] / base:7.2f}x "
              f"{s['grammar_ms_per_token']:14.3f} {s['exact']:>3}/{s['prompts']} {s['valid']:>3}/{s['prompts']}")
    if not args.quick:
        config = f"{cfg.window}-{cfg.ngram}-{cfg.guesses}"
        save_json("structured", {"machine": machine(), "command": "python bench/structured.py", "config": config,
                                 "max_new_tokens": limit, "repeat": repeat,
                                 "summary": summary, "rows": rows})


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
