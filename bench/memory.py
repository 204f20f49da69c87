"""Resident memory of the default model in the batch-invariant mode: its parameters kept beside the packed copies (a
`Llama` as `from_pretrained` gives it) against `Llama.keep_weights_once` (the packed copies alone: what `lookahead
generate` and `lookahead serve` run), in float32 and bfloat16.

Each in a fresh process: VmRSS with torch and the package imported (the base), then the model loaded (and its weights
released, where asked), then after decoding 64 tokens after a 64-token prompt, plainly and with lookahead; reported
over the base, beside the weights' bytes and the KV cache's. The goal (issue 48): at most 1.2x weights + KV.

    python bench/memory.py                  # float32 and bfloat16, kept and once; writes bench/results/memory-cpu.json
    python bench/memory.py --quick          # float32, once: prints its JSON line (a test's check), writes nothing
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import machine, print_table, save_json

MEASURE = """
import json, sys
import torch
from lookahead import LookaheadConfig
from lookahead.models import Llama, default_model_dir

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

base = rss()
folder, dtype, once = sys.argv[1] or default_model_dir(), getattr(torch, sys.argv[2]), sys.argv[3] == "once"
model = Llama.from_pretrained(folder, dtype=dtype)
weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
released = model.keep_weights_once() if once else 0
loaded = rss() - base
for lookahead in (None, LookaheadConfig()):
    model.generate(list(range(100, 164)), max_new_tokens=64, eos_token_id=[], lookahead=lookahead)
pool = model.runner.pool
kv = sum(t.numel() * t.element_size() for t in (pool.k, pool.v))
print(json.dumps({"dtype": sys.argv[2], "once": once, "weights": weights, "released": released, "kv": kv,
                  "loaded": loaded, "decoded": rss() - base}))
"""


def measure(folder: str, dtype: str, once: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, folder, dtype, "once" if once else "kept"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {dtype} ({'once' if once else 'kept'}) failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["ratio"] = row["decoded"] / (row["weights"] + row["kv"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a checkpoint folder (default: the default model)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        print(json.dumps(measure(args.model, "float32", True)))
        return
    rows = [measure(args.model, dtype, once) for dtype in ("float32", "bfloat16") for once in (False, True)]
    mb = 2 ** 20
    print_table(["dtype", "weights", "weights MB", "KV MB", "loaded MB", "decoded MB", "decoded / (weights + KV)"],
                [[r["dtype"], "once" if r["once"] else "kept", f"{r['weights'] / mb:.0f}", f"{r['kv'] / mb:.0f}",
                  f"{r['loaded'] / mb:.0f}", f"{r['decoded'] / mb:.0f}", f"{r['ratio']:.2f}"] for r in rows])
    print(save_json("memory", {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
