"""The batch-invariant mode's CPU GEMM (`lookahead.kernels.cpu_kernels`) on this CPU, by row count, at the default
model's shapes (SmolLM2-135M: q/k/v side by side, gate/up side by side, down, the 49,152-wide logits): bfloat16
weights through the bf16 dot products (`pairs`, where the CPU has AVX512-BF16) and through the widening path, float32
weights, and torch's own `F.linear` in bfloat16 (oneDNN; not batch-invariant) as the reference a library reaches.
Microseconds per call, best of `--repeat` rounds of interleaved calls (the implementations take turns, so a shared
machine's load falls on all alike). Prints a table and saves bench/results/cpu-gemm-cpu.json.

    python bench/cpu_gemm.py                 # rows 1, 4, 18, 64
    python bench/cpu_gemm.py --quick         # rows 1 and 4, a few calls; saves nothing (CI)
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, print_table, save_json
from lookahead.kernels import cpu_kernels

SHAPES = {"q/k/v": (576 + 2 * 192, 576), "gate/up": (2 * 1536, 576), "down": (576, 1536), "logits": (49152, 576)}


def _implementations(weight: torch.Tensor) -> dict:
    """name -> (call on rows, the rows' dtype)."""
    pairs = cpu_kernels.pack(weight) if cpu_kernels.pairs() else None
    widened = cpu_kernels.pack(weight, widen=True)  # the widening path's layout, whatever this CPU has
    fp32 = cpu_kernels.pack(weight.float())
    found = {"kernel bf16 (dot products)": (lambda x: cpu_kernels.gemm(x, pairs), torch.bfloat16)} if pairs else {}
    found["kernel bf16 (widened)"] = (lambda x: cpu_kernels.gemm(x, widened), torch.float32)
    found["kernel fp32"] = (lambda x: cpu_kernels.gemm(x, fp32), torch.float32)
    found["torch F.linear bf16"] = (lambda x: torch.nn.functional.linear(x, weight), torch.bfloat16)
    return found


def measure(rows: list[int], calls: int, repeat: int) -> list[dict]:
    torch.manual_seed(0)
    records = []
    for shape_name, (n, k) in SHAPES.items():
        implementations = _implementations(torch.randn(n, k).to(torch.bfloat16))
        for m in rows:
            x = torch.randn(m, k)
            best = {name: float("inf") for name in implementations}
            for _ in range(repeat):
                for name, (call, dtype) in implementations.items():
                    rows_in = x.to(dtype)
                    call(rows_in)  # warm
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(rows_in)
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
            for name, seconds in best.items():
                records.append({"shape": shape_name, "n": n, "k": k, "rows": m, "implementation": name,
                                "us": seconds * 1e6})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 18, 64])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="rows 1 and 4, a few calls; saves nothing")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.calls, args.repeat = [1, 4], 2, 1
    if not cpu_kernels.available():
        raise SystemExit("the CPU GEMM kernel could not be built here (see the warning above)")
    records = measure(args.rows, args.calls, args.repeat)
    names = list(dict.fromkeys(r["implementation"] for r in records))
    table = {}
    for r in records:
        table.setdefault((r["shape"], r["rows"]), {})[r["implementation"]] = r["us"]
    print_table(["shape", "rows", *names], [[shape, m, *(f"{cells[name]:.0f}" for name in names)]
                                            for (shape, m), cells in table.items()])
    if not args.quick:
        path = save_json("cpu-gemm", {"machine": machine(), "pairs": cpu_kernels.pairs(),
                                      "bf16_feature": cpu_kernels.bf16_dot_products(), "calls": args.calls,
                                      "repeat": args.repeat, "records": records})
        print(f"saved {path}")


if __name__ == "__main__":
    main()
