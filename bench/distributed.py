"""Lookahead parallelism: K processes (K = 1, 2, ... ranks of one gloo or NCCL group) against tokens/s and S.

For each K the script spawns K ranks that each load the default model, join one process group (gloo on a
CPU, NCCL with one GPU per rank) and decode the same prompts from bench/data/dev.jsonl with
`Llama.generate(process_group=...)`, for each whole-step configuration (W-N-G: the step all ranks share);
K = 1 also decodes plainly, the baseline. The accepted entries' KV reach every rank by a broadcast from the rank
that computed them; what the authors' re-feed would cost instead (a sub-step n tokens longer) is measured beside
it per step (`kv_sync_costs`). Rank 0 reports tokens/s
(wall time of the whole generation), S and whether the tokens equal K = 1's.

On a CPU the ranks share its cores: each rank gets cores // K threads, so K = 2 on two cores is two
one-thread processes against one two-thread process. Saves JSON and a PNG in bench/results/.

    python bench/distributed.py --quick         # a few minutes: 2 prompts, 32 tokens
    python bench/distributed.py                 # 4 prompts, 64 tokens, K = 1, 2 (more with more GPUs)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import queue  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common import chat_ids, cold, load_prompts, machine, print_table, save_json  # noqa: E402
from lookahead import LookaheadConfig  # noqa: E402

PLAIN = "plain"


def kv_sync_costs(model, group, prompt: list[int], tokens: int, repeats: int = 15) -> dict:
    """What each KV sync costs per step, measured on every rank at once (as in a generation): "broadcast" sends
    n entries [2, layers, Hkv, n, D] from rank 0; "refeed" runs n more tokens in a sub-step of `tokens` tokens.
    Medians in ms, rank 0's."""
    from lookahead import Request
    from lookahead.kernels import StepPattern
    from lookahead.models.generation import runner_for

    request = Request([prompt], tokens + 8, lookahead=LookaheadConfig(2, 4, 5))  # 21-token steps
    runner = runner_for(model, request).sequence(len(prompt) + tokens + 32)
    runner.prefill(prompt)
    costs = {"broadcast_ms": {}, "forward_ms": {}}
    for n in (1, 2, 3):
        entries = runner.empty_entries(n).zero_()
        samples = []
        for _ in range(repeats):
            dist.barrier(group)
            start = time.perf_counter()
            dist.broadcast(entries, 0, group=group)
            samples.append(time.perf_counter() - start)
        costs["broadcast_ms"][n] = 1000 * sorted(samples)[len(samples) // 2]
    for extra in (0, 1, 2, 3):
        size = tokens + extra
        chain = StepPattern(1, 2, tree_end=tuple([size - 1] * extra + list(range(extra + 1, size))))
        samples = []
        for _ in range(repeats):  # no commit: every step writes at the same L
            dist.barrier(group)
            start = time.perf_counter()
            runner.step(prompt[:1] * size, chain, [0])
            samples.append(time.perf_counter() - start)
        costs["forward_ms"][extra] = 1000 * sorted(samples)[len(samples) // 2]
    return costs


def rank_main(rank: int, world: int, store: str, folder: str, prompts: list, methods: list, max_new_tokens: int,
              threads: int, results, sub_tokens: int = 12) -> None:
    """One rank: join the group, warm up, decode every prompt with every method; rank 0 puts its records."""
    from lookahead.models import Llama

    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    model = Llama.from_pretrained(folder, dtype="float32", device=device)
    group = dist.group.WORLD
    records = []

    def run(ids, config, tokens=max_new_tokens):
        return model.generate(ids, max_new_tokens=tokens, lookahead=config,
                              process_group=None if config is None else group)

    with torch.inference_mode():
        for _, config in methods:  # warm-up: allocations, kernels, the first collectives
            run(prompts[0], config, tokens=8)
        for p, ids in enumerate(prompts):
            for name, config in methods:
                cold(model)  # the whole prompt prefilled by every method
                dist.barrier()  # every rank starts the generation together
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                result = run(ids, config)
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                records.append({"K": world, "method": name, "prompt": p, "tokens": len(result.tokens),
                                "steps": result.steps, "seconds": seconds, "ids": result.tokens})
        if world > 1:
            costs = kv_sync_costs(model, group, prompts[0], sub_tokens)
            if rank == 0:
                records.append({"K": world, "kv_sync_costs": costs})
    if rank == 0:
        results.put(records)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, folder: str, prompts: list, methods: list, max_new_tokens: int, threads: int) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=rank_main, args=(rank, world, store, folder, prompts, methods, max_new_tokens,
                                                     threads, results)) for rank in range(world)]
        for proc in procs:
            proc.start()
        try:
            records = results.get(timeout=3600)
        except queue.Empty:
            records = []
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if not records:
        raise RuntimeError(f"K={world}: no results (a rank failed; see its traceback above)")
    return records


def summarize(records: list[dict]) -> list[dict]:
    records = [r for r in records if "method" in r]
    reference = {r["prompt"]: r["ids"] for r in records if r["K"] == 1 and r["method"] == PLAIN}
    plain_rate = sum(r["tokens"] for r in records if r["K"] == 1 and r["method"] == PLAIN) / sum(
        r["seconds"] for r in records if r["K"] == 1 and r["method"] == PLAIN)
    table = []
    for key in dict.fromkeys((r["K"], r["method"]) for r in records):
        rows = [r for r in records if (r["K"], r["method"]) == key]
        tokens, seconds, steps = (sum(r[f] for r in rows) for f in ("tokens", "seconds", "steps"))
        table.append({"K": key[0], "method": key[1], "S": tokens / steps, "tok_s": tokens / seconds,
                      "vs_plain": tokens / seconds / plain_rate, "n": len(rows),
                      "exact": sum(r["ids"] == reference[r["prompt"]] for r in rows)})
    return table


def plot(table: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    labels = [f"K={r['K']}\n{r['method']}" for r in table]
    for ax, key, title in ((axes[0], "tok_s", "tokens/s (wall, rank 0)"), (axes[1], "S", "S (tokens / step)")):
        ax.bar(range(len(table)), [r[key] for r in table], color=["C0" if r["K"] == 1 else "C1" for r in table])
        ax.set_xticks(range(len(table)), labels, fontsize=7)
        ax.set_title(title)
    fig.suptitle("lookahead parallelism (bench/distributed.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=1, help="prompts of each kind (chat, code, math, summarize)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="*", default=None,
                        help="K values (default: 1, 2, and 4, 8 where that many GPUs exist)")
    parser.add_argument("--configs", nargs="*", default=["3-4-3", "6-4-6"], help="whole-step configs W-N-G")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens")
    parser.add_argument("--name", default="distributed", help="results file stem")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from lookahead.models.default_model import default_model_dir

    folder = str(args.model or default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    kinds = ("code", "chat") if args.quick else ("chat", "code", "math", "summarize")
    prompts = [chat_ids(tokenizer, row["prompt"]) for row in load_prompts(args.per_kind, kinds)]
    max_new_tokens = 32 if args.quick else args.max_new_tokens
    gpus = torch.cuda.device_count()
    ranks = args.ranks or [k for k in (1, 2, 4, 8) if k <= max(2, gpus)]
    cores = os.cpu_count() or 1
    configs = [LookaheadConfig(*map(int, c.split("-"))) for c in args.configs]
    records = []
    for world in ranks:
        methods = [(PLAIN, None)] if world == 1 else []
        methods += [(c, config) for c, config in zip(args.configs, configs, strict=True) if config.window >= world]
        threads = 1 if gpus else max(1, cores // world)
        print(f"K={world}: {len(methods)} methods, {threads} thread(s) per rank ...", flush=True)
        records += run_world(world, folder, prompts, methods, max_new_tokens, threads)
    table = summarize(records)
    costs = [r for r in records if "kv_sync_costs" in r]
    info = machine()
    print(f"\n{len(prompts)} prompts, {max_new_tokens} new tokens, {info['device']}, {cores} cores")
    print_table(["K", "method (whole step W-N-G)", "S", "tokens/s", "vs plain K=1", "same as K=1 plain"],
                [[r["K"], r["method"], f"{r['S']:.2f}", f"{r['tok_s']:.2f}", f"{r['vs_plain']:.2f}x",
                  f"{r['exact']}/{r['n']}"] for r in table])
    for cost in costs:
        c = cost["kv_sync_costs"]
        print(f"\nK={cost['K']}, per step, medians of rank 0 (all ranks at once): broadcast of n entries vs a "
              f"sub-step of 12 + n tokens")
        print_table(["n", "broadcast ms", "forward ms (12 + n tokens)", "re-feed's extra ms"],
                    [[n, f"{c['broadcast_ms'][n]:.2f}", f"{c['forward_ms'][n]:.1f}",
                      f"{c['forward_ms'][n] - c['forward_ms'][0]:.1f}"] for n in (1, 2, 3)])
    result = {"machine": info, "cores": cores, "max_new_tokens": max_new_tokens, "prompts": len(prompts),
              "ranks": ranks, "configs": args.configs, "records": records, "summary": table}
    path = save_json(args.name, result)
    plot(table, path.with_suffix(".png"))
    print(f"\nsaved {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
