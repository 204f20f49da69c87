"""The batch-invariant mode's cost: plain and lookahead decoding with the mode on and off, one prompt and a batch of
four, float32 and bfloat16, on the default model.

Each (dtype, mode) is its own model from the same checkpoint; on every prompt the four models take turns (the order
rotating from prompt to prompt), each generating plain and then lookahead (the default `LookaheadConfig()`, self-tuned
with the model's own measured costs), so machine noise hits them alike. Prints tokens/s per (dtype, mode, batch,
method), the mode's ratio to the mode off, lookahead's speedup over plain in each mode, and how many answers equal
plain greedy's; saves bench/results/invariant-<device>.json.

    python bench/invariant.py                 # 4 prompts, 64 tokens, batch 1 and 4
    python bench/invariant.py --quick         # 2 prompts, 24 tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from common import chat_ids, cold, load_prompts, machine, print_table, save_json, sync
from lookahead import LookaheadConfig
from lookahead.models import Llama, default_model_dir

DTYPES = ("float32", "bfloat16")


def timed_generate(model, prompts, max_new_tokens: int, lookahead) -> tuple[list[list[int]], float, int]:
    """(each prompt's tokens, wall seconds, tokens) of one generation of `prompts` (a list: a batch)."""
    cold(model)
    sync()
    start = time.perf_counter()
    results = model.generate(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=max_new_tokens,
                             lookahead=lookahead, eos_token_id=[])
    sync()
    seconds = time.perf_counter() - start
    results = results if isinstance(results, list) else [results]
    return [r.tokens for r in results], seconds, sum(len(r.tokens) for r in results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (one per kind, then the next of each)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="the batch's size (its prompts: the first ones)")
    args = parser.parse_args(argv)
    count, new_tokens = (2, 24) if args.quick else (args.prompts, args.max_new_tokens)
    folder = default_model_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rows = load_prompts(per_kind=max(1, -(-count // 4)))[:count]
    prompts = [chat_ids(tokenizer, row["prompt"]) for row in rows]
    models = {}
    for dtype in DTYPES:
        for mode in (False, True):
            start = time.perf_counter()
            model = Llama.from_pretrained(folder, dtype=dtype, batch_invariant=mode,
                                          device="cuda" if torch.cuda.is_available() else "cpu")
            model.generate(prompts[0], max_new_tokens=2, lookahead=LookaheadConfig())  # costs measured, kernels built
            print(f"{dtype} mode {'on' if mode else 'off'}: ready in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
            models[(dtype, mode)] = model
    load = os.getloadavg()[0]  # the 1-minute load average before and after the timed runs
    runs = []
    cases = [("1", [[p] for p in prompts]), (str(args.batch), [prompts[: args.batch]])]
    keys = list(models)
    for batch, groups in cases:
        for turn, group in enumerate(groups):
            for key in keys[turn % len(keys):] + keys[: turn % len(keys)]:
                model = models[key]
                plain, plain_s, plain_n = timed_generate(model, group, new_tokens, None)
                ahead, ahead_s, ahead_n = timed_generate(model, group, new_tokens, LookaheadConfig())
                runs.append({"dtype": key[0], "mode": key[1], "batch": int(batch), "prompt": turn,
                             "plain_s": plain_s, "plain_tokens": plain_n, "lookahead_s": ahead_s,
                             "lookahead_tokens": ahead_n, "exact": sum(a == b for a, b in zip(plain, ahead,
                                                                                           strict=True)),
                             "answers": len(group)})
                print(f"batch {batch} prompt {turn} {key[0]} mode {'on' if key[1] else 'off'}: plain "
                      f"{plain_n / plain_s:.1f} tok/s, lookahead {ahead_n / ahead_s:.1f} tok/s", file=sys.stderr)
    summary = summarize(runs)
    headers = ["dtype", "batch", "mode", "plain tok/s", "lookahead tok/s", "lookahead / plain", "plain: on / off",
               "exact"]
    print_table(headers, [[s["dtype"], s["batch"], "on" if s["mode"] else "off", f"{s['plain']:.1f}",
                           f"{s['lookahead']:.1f}", f"{s['speedup']:.2f}x",
                           f"{s['plain_vs_off']:.2f}x" if s["mode"] else "", f"{s['exact']}/{s['answers']}"]
                          for s in summary])
    command = "python bench/invariant.py" + (" --quick" if args.quick else "")
    path = save_json("invariant", {"machine": {**machine(), "command": command}, "load": [load, os.getloadavg()[0]],
                                   "max_new_tokens": new_tokens,
                                   "prompts": [row["id"] for row in rows], "runs": runs, "summary": summary})
    print(f"saved {path}")
    return 0


def summarize(runs: list[dict]) -> list[dict]:
    """Per (dtype, batch, mode): tokens/s summed over prompts (total tokens / total seconds), the speedup, and the
    mode's plain tokens/s against the mode off's."""
    table = {}
    for run in runs:
        entry = table.setdefault((run["dtype"], run["batch"], run["mode"]), dict.fromkeys(
            ("plain_s", "plain_tokens", "lookahead_s", "lookahead_tokens", "exact", "answers"), 0))
        for field in entry:
            entry[field] += run[field]
    summary = []
    for (dtype, batch, mode), e in sorted(table.items()):
        plain, ahead = e["plain_tokens"] / e["plain_s"], e["lookahead_tokens"] / e["lookahead_s"]
        off = table[(dtype, batch, False)]
        summary.append({"dtype": dtype, "batch": batch, "mode": mode, "plain": plain, "lookahead": ahead,
                        "speedup": ahead / plain, "plain_vs_off": plain / (off["plain_tokens"] / off["plain_s"]),
                        "lookahead_vs_off": ahead / (off["lookahead_tokens"] / off["lookahead_s"]),
                        "exact": e["exact"], "answers": e["answers"]})
    return summary


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
