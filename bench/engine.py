"""Continuous batching: lookahead rows against plain rows in the engine, at 1, 2, 4 and 8 requests in flight.

A closed loop keeps `c` requests in flight on one engine (`lookahead.models.engine_for`): when one finishes the next
prompt of bench/data/dev.jsonl joins (after its prefill, in chunks beside the decoding rows). Each round decodes the
same prompts once with plain rows and once with lookahead rows (the default configuration, self-tuned per row by the
batch-wide budget), the two interleaved and their order alternating from round to round; the prefix cache is
cleared and the drafting memory is off before each run, so neither method inherits the other's work. Reports per
concurrency: tokens/s of each method (all rows' tokens over the run's wall time), their ratio, S (tokens per forward
pass a row took part in) and the draft nodes the budget gave each lookahead row per step, by the number of rows
decoding in that step (a histogram per batch size: JSON and a plot). Every lookahead answer is checked against the
plain one (greedy: token for token).

Where the time goes, over the steps in which all c rows decode (no prompt chunk, no row missing): per step, the
model's time, the engine's own (the rest of `Engine.step`: drafting, packing, verifying, committing, scheduling),
the tokens fed and the tokens given, for each method. Set side by side they say what lookahead's extra tokens cost
(model ms per extra token fed, against a plain step's ms per token: the acceptance a draft node needs to pay, its
"break-even") and what they gave (tokens given per extra token fed: the nodes' acceptance).

    python bench/engine.py --quick      # 4 prompts, 32 tokens, c = 1, 2, 4
    python bench/engine.py              # 16 prompts, 128 tokens, c = 1, 2, 4, 8, two rounds
    python bench/engine.py --dtype bfloat16 --name engine-bf16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from common import RESULTS, chat_ids, load_model, load_prompts, machine, print_table, save_json  # noqa: E402
from lookahead import LookaheadConfig, Request  # noqa: E402
from lookahead.models import engine_for  # noqa: E402
from results_page import FULL_HEADERS, PARTS_HEADERS, full_rows, parts_rows  # noqa: E402

PLAIN, LOOKAHEAD = "plain", "lookahead 1-4-5@auto"


def run(engine, prompts, concurrency: int, max_new_tokens: int, lookahead, eos: list[int]) -> dict:
    """Decode `prompts` keeping `concurrency` in flight: tokens, seconds, forward passes per row, the answers,
    (lookahead) each decoding row's draft nodes per step by the rows decoding in it, the mean step with all
    `concurrency` rows decoding (`full`: its model and engine milliseconds, tokens fed and given), and the run's steps
    in three parts (`parts`: steps, seconds, tokens given): those with every row decoding, those carrying a prompt
    chunk, those with fewer rows decoding (a request waits for none: the run's tail)."""
    engine.model.clear_cache()
    nodes: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    step: dict = {}

    def on_step(steps, seconds):
        decoding = [s for s in steps if not s.prefill]
        step.update(seconds=seconds, fed=sum(len(s.tokens) for s in steps), decoding=len(decoding),
                    prefill=len(decoding) < len(steps))
        if lookahead is not None:
            for s in decoding:  # a plain row step verifies no node
                nodes[len(decoding)][s.pattern.verify_len] += 1

    given = [0]  # tokens sent to every request so far

    def submit(ids):
        handle = None

        def sink(delta):  # count, then queue as the handle would
            given[0] += len(delta.tokens)
            handle.put(delta)

        handle = engine.submit(Request([ids], max_new_tokens, lookahead=lookahead, stop=frozenset(eos)), sink=sink)
        return handle

    engine.on_step = on_step
    waiting = collections.deque(enumerate(prompts))
    live, answers = {}, {}
    parts: dict[str, list] = {"full": [], "chunk": [], "fewer": []}
    start = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < concurrency:
            i, ids = waiting.popleft()
            live[i] = submit(ids)
        step.clear()
        before, began = given[0], time.perf_counter()
        engine.step()
        wall = time.perf_counter() - began
        if step:
            kind = "chunk" if step["prefill"] else "full" if step["decoding"] == concurrency else "fewer"
            parts[kind].append((step["seconds"], wall - step["seconds"], step["fed"], given[0] - before))
        for i in [i for i, handle in live.items() if handle.done]:
            answers[i] = live.pop(i).result()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in answers.values())
    steps = sum(r.steps for r in answers.values())
    full = parts["full"]
    mean = [statistics.fmean(column) for column in zip(*full, strict=True)] if full else [0.0] * 4
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "S": tokens / steps,
            "answers": {i: r.tokens for i, r in answers.items()},
            "nodes": {b: dict(counter) for b, counter in nodes.items()},
            "full": {"steps": len(full), "model_ms": 1000 * mean[0], "engine_ms": 1000 * mean[1], "fed": mean[2],
                     "given": mean[3]},
            "parts": {kind: {"steps": len(rows), "seconds": sum(m + e for m, e, _, _ in rows),
                             "given": sum(g for *_, g in rows)} for kind, rows in parts.items()}}


def full_steps(records: list[dict], concurrency: int) -> dict:
    """The steps with every row decoding at `concurrency`, both methods (medians over rounds), and what lookahead's
    extra tokens cost and gave there: model ms per extra token fed (`extra_ms`) against plain's ms per token
    (`plain_ms_per_token`); their ratio, the acceptance a node needs to pay for its model time (`break_even`); tokens
    given per extra token fed (`acceptance`)."""
    def median(method: str, key: str) -> float:
        return statistics.median(x["full"][key] for x in records if x["concurrency"] == concurrency
                                 and x["method"] == method)

    if not all(x["full"]["steps"] for x in records if x["concurrency"] == concurrency):
        return {}
    plain = {key: median(PLAIN, key) for key in ("model_ms", "engine_ms", "fed", "given")}
    ahead = {key: median(LOOKAHEAD, key) for key in ("model_ms", "engine_ms", "fed", "given")}
    extra = ahead["fed"] - plain["fed"]
    per_token = plain["model_ms"] / plain["fed"]
    extra_ms = (ahead["model_ms"] - plain["model_ms"]) / extra if extra > 0 else 0.0
    return {"plain": plain, "lookahead": ahead, "plain_ms_per_token": per_token, "extra_ms": extra_ms,
            "break_even": extra_ms / per_token,
            "acceptance": (ahead["given"] - plain["given"]) / extra if extra > 0 else 0.0}


def run_parts(records: list[dict], concurrency: int) -> dict:
    """Per method, the run's steps in their three parts (`run`'s `parts`), medians over rounds."""
    out = {}
    for method in (PLAIN, LOOKAHEAD):
        runs = [x["parts"] for x in records if x["concurrency"] == concurrency and x["method"] == method]
        out[method] = {kind: {key: statistics.median(r[kind][key] for r in runs)
                              for key in ("steps", "seconds", "given")} for kind in ("full", "chunk", "fewer")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, nargs="+")
    parser.add_argument("--per-kind", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (float32: comparable across machines)")
    parser.add_argument("--name", default="engine")
    args = parser.parse_args()
    levels = args.concurrency or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    per_kind = args.per_kind or (1 if args.quick else 4)
    max_new = args.tokens or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 2)
    _, model, tokenizer = load_model(dtype=args.dtype)
    prompts = [chat_ids(tokenizer, row["prompt"]) for row in load_prompts(per_kind)]
    eos = [tokenizer.eos_token_id]
    engine = engine_for(model, max_batch=max(levels), lookahead=LookaheadConfig(), warm=False)
    methods = {PLAIN: None, LOOKAHEAD: LookaheadConfig(warm=False)}
    records = []
    for c in levels:
        for r in range(rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            got = {name: run(engine, prompts, c, max_new, methods[name], eos) for name in order}
            exact = sum(got[LOOKAHEAD]["answers"][i] == got[PLAIN]["answers"][i] for i in got[PLAIN]["answers"])
            for name in order:
                records.append({"concurrency": c, "round": r, "method": name, "exact": exact,
                                **{k: v for k, v in got[name].items() if k != "answers"}})
            print(f"c={c} round {r}: plain {got[PLAIN]['tok_s']:.1f} tok/s, lookahead {got[LOOKAHEAD]['tok_s']:.1f} "
                  f"tok/s (S {got[LOOKAHEAD]['S']:.2f}), {exact}/{len(prompts)} exact", flush=True)
    summary = []
    for c in levels:
        rate = {name: statistics.median(x["tok_s"] for x in records if x["concurrency"] == c and x["method"] == name)
                for name in methods}
        s = statistics.median(x["S"] for x in records if x["concurrency"] == c and x["method"] == LOOKAHEAD)
        exact = min(x["exact"] for x in records if x["concurrency"] == c)
        nodes: collections.Counter = collections.Counter()
        for x in records:
            if x["concurrency"] == c and x["method"] == LOOKAHEAD:
                for counter in x["nodes"].values():
                    nodes.update(counter)
        total = sum(nodes.values())
        summary.append({"concurrency": c, "plain_tok_s": rate[PLAIN], "lookahead_tok_s": rate[LOOKAHEAD],
                        "ratio": rate[LOOKAHEAD] / rate[PLAIN], "S": s, "exact": exact, "prompts": len(prompts),
                        "plain_row_steps": nodes.get(0, 0) / total if total else 0.0,
                        "mean_nodes": sum(n * k for n, k in nodes.items()) / total if total else 0.0,
                        "full": full_steps(records, c), "parts": run_parts(records, c)})
    print_table(["in flight", "plain tok/s", "lookahead tok/s", "ratio", "S", "rows plain", "nodes/row", "exact"],
                [[x["concurrency"], f"{x['plain_tok_s']:.1f}", f"{x['lookahead_tok_s']:.1f}", f"{x['ratio']:.2f}x",
                  f"{x['S']:.2f}", f"{x['plain_row_steps']:.0%}", f"{x['mean_nodes']:.1f}",
                  f"{x['exact']}/{x['prompts']}"] for x in summary])
    print("\nsteps with every row decoding (means; medians over rounds):")
    print_table(FULL_HEADERS, full_rows(summary))
    print("\neach run's steps in three parts (medians over rounds):")
    print_table(PARTS_HEADERS, parts_rows(summary))
    payload = {"machine": machine(), "command": "python bench/engine.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in vars(args).items()
        if v not in (None, False) and k != "name"), "form": "tree", "dtype": args.dtype, "max_new_tokens": max_new,
        "summary": summary, "records": records}
    path = save_json(args.name, payload)
    plot(summary, records, path.with_suffix(".png"))
    print(path)


def plot(summary, records, path) -> None:
    """Throughput ratio against concurrency, and the draft nodes per row histogram per batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([x["concurrency"] for x in summary], [x["ratio"] for x in summary], "o-")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="requests in flight", ylabel="lookahead / plain tokens/s", xscale="log", title="throughput")
    by_batch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for x in records:
        if x["method"] == LOOKAHEAD:
            for b, counter in x["nodes"].items():
                by_batch[int(b)].update({int(n): k for n, k in counter.items()})
    for b in sorted(by_batch):
        counter = by_batch[b]
        total = sum(counter.values())
        sizes = sorted(counter)
        right.plot(sizes, [counter[n] / total for n in sizes], "o-", label=f"{b} row(s) decoding")
    right.set(xlabel="draft nodes a row verified", ylabel="share of row steps", title="per-row sizes")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    RESULTS.mkdir(exist_ok=True)


if __name__ == "__main__":
    main()
