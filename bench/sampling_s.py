"""Compression S with sampling against greedy on the dev prompts (the paper's Table 2 compares them).

Sampling verification (Algorithm 4) accepts a candidate token with its target probability, so S is
lower than greedy's; the output distribution is unchanged (tests/test_sampling.py checks that).

    python bench/sampling_s.py --per-kind 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse

import torch

from common import chat_ids, load_model, load_prompts, machine, print_table, save_json
from lookahead import LookaheadConfig

SETTINGS = [("greedy", 0.0, 0, 1.0), ("T=1.0", 1.0, 0, 1.0), ("T=0.7", 0.7, 0, 1.0), ("T=0.7 top-p 0.9", 0.7, 0, 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="*", default=["5-4-5", "7-5-7"])
    args = parser.parse_args()
    folder, model, tokenizer = load_model(args.model)
    rows = load_prompts(args.per_kind)
    results = []
    with torch.inference_mode():
        for spec in args.configs:
            cfg = LookaheadConfig(*map(int, spec.split("-")))
            for label, temperature, top_k, top_p in SETTINGS:
                tokens = steps = 0
                for seed, row in enumerate(rows):
                    result = model.generate(chat_ids(tokenizer, row["prompt"]), max_new_tokens=args.max_new_tokens,
                                            lookahead=cfg, temperature=temperature, top_k=top_k, top_p=top_p,
                                            seed=seed)
                    tokens, steps = tokens + len(result.tokens), steps + result.steps
                results.append({"config": spec, "setting": label, "S": tokens / steps, "tokens": tokens})
                print(f"{spec} {label}: S={tokens / steps:.2f}", flush=True)
    print(f"\nS with sampling vs greedy ({len(rows)} dev prompts, {args.max_new_tokens} tokens)")
    print_table(["W-N-G", "setting", "S"], [[r["config"], r["setting"], f"{r['S']:.2f}"] for r in results])
    print(save_json("sampling-s", {"machine": machine(), "rows": results}))


if __name__ == "__main__":
    main()
