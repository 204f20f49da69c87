"""Where a decoding step's time goes on the CPU: the torch profiler over plain steps (one token) and full lookahead
steps (`LookaheadConfig(budget="fixed")`: 18 tokens a step), in the default mode, per dtype.

Each step's wall time is split into the GEMMs (the package's kernel, by output width: q/k/v side by side, o, gate/up
side by side, down, the logits), attention, the norms, dtype conversions, the KV cache's writes, the other torch ops,
and what is left: Python and the loop's own work between the ops. Milliseconds per step, self times (an op's time
without the ops it calls), from one generation of `--tokens` tokens after a warm-up. The profile runs the decoder
layers one by one from Python (the profiler sees ops called from Python only); beside it, each step's time without
the profiler (best of 3, from the first decoding step's tokens to the last's), the layers one by one and in one
call of the CPU kernels (`cpu_kernels.decoder_step`, the default: the embedding, layers, final norm and head).
Lookahead steps draft cold (`warm=False`): a repeated prompt would otherwise be drafted from memory of the last run.

    python bench/profile_step.py              # bfloat16 and float32, 48 tokens
    python bench/profile_step.py --quick      # float32, 8 tokens
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import collections  # noqa: E402
import time  # noqa: E402

from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from common import chat_ids, load_prompts, machine, print_table, save_json  # noqa: E402
from lookahead import LookaheadConfig  # noqa: E402
from lookahead.kernels import cpu_kernels  # noqa: E402

CATEGORIES = {  # an aten op's category by its name (the first that matches); the kernels' own are named below
    "norms": ("rms_norm", "pow", "mean", "rsqrt"),
    "dtype conversions": ("aten::to", "aten::_to_copy", "aten::copy_"),
    "KV cache writes": ("index_copy", "index_put"),
}


def traced(fn, name_of):
    """`fn` with a profiler label per call (the kernels are not torch ops: the profiler would not see them)."""
    def call(*args, **kwargs):
        with record_function(name_of(*args)):
            return fn(*args, **kwargs)
    return call


def breakdown(prof, wall: float, steps: int, vocab: int, widths: dict[int, str]) -> dict[str, float]:
    """Milliseconds per step by category, from the profiler's self times; "Python and the loop" is what is left."""
    parts: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        name, seconds = event.key, event.self_cpu_time_total / 1e6
        if name.startswith("GEMM "):
            width = int(name.split()[1])
            parts["GEMM: logits" if width == vocab else f"GEMM: {widths.get(width, width)}"] += seconds
        elif name == "attention (kernel)":
            parts["attention"] += seconds
        elif name.startswith("aten::"):
            kind = next((k for k, keys in CATEGORIES.items() if any(key in name for key in keys)), "other torch ops")
            parts[kind] += seconds
    parts["Python and the loop"] = max(0.0, wall - sum(parts.values()))
    return {name: 1e3 * seconds / steps for name, seconds in sorted(parts.items())}


def decoding_ms(model, prompt: list[int], tokens: int, lookahead) -> float:
    """Milliseconds per decoding step of one generation, without the profiler: from the first step's tokens to the
    last's (the prefill before them is not a decoding step)."""
    times = []
    model.generate(prompt, max_new_tokens=tokens, lookahead=lookahead, eos_token_id=[],
                   stream=lambda new: times.append(time.perf_counter()))
    return 1e3 * (times[-1] - times[0]) / max(len(times) - 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.dtypes = 8, ["float32"]

    from transformers import AutoTokenizer

    from lookahead.models import Llama
    from lookahead.models.default_model import default_model_dir
    from lookahead.models.invariant import InvariantOps

    cpu_kernels.gemm = traced(cpu_kernels.gemm, lambda x, packed: f"GEMM {packed.out_features}")
    cpu_kernels.attention = traced(cpu_kernels.attention, lambda *a: "attention (kernel)")
    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = chat_ids(tokenizer, load_prompts(per_kind=1, kinds=("chat",))[0]["prompt"])
    rows, records, timed = [], [], []
    for dtype in args.dtypes:
        model = Llama.from_pretrained(folder, dtype=dtype)
        cfg = model.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        widths = {q + 2 * kv: "q/k/v", cfg.hidden_size: "o, down", 2 * cfg.intermediate_size: "gate/up"}
        for kind, lookahead in (("plain", None), ("lookahead 18", LookaheadConfig(budget="fixed", warm=False))):
            model.generate(prompt, max_new_tokens=8, lookahead=lookahead)  # warm: kernels built, costs measured
            # unprofiled, both ways: the layers in one call of the CPU kernels (the default), and one by one
            unprofiled = {}
            for way, whole in (("one call", True), ("one by one", False)):
                InvariantOps.whole_step = whole
                unprofiled[way] = min(decoding_ms(model, prompt, args.tokens, lookahead) for _ in range(3))
            # the profile, of the layers one by one (run from Python, so the profiler sees each op)
            if model.runner is not None:
                model.runner.clear_cache()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                result = model.generate(prompt, max_new_tokens=args.tokens, lookahead=lookahead, eos_token_id=[])
                wall = time.perf_counter() - start
            InvariantOps.whole_step = True
            steps = result.steps - 1  # the prefill's pass is not a decoding step; its time is in the first share
            parts = breakdown(prof, wall, max(steps, 1), cfg.vocab_size, widths)
            total = sum(parts.values())
            records.append({"dtype": dtype, "step": kind, "steps": steps, "tokens": len(result.tokens),
                            "ms_per_step": total, "batch_invariant": model.batch_invariant, "parts": parts,
                            "unprofiled_ms": unprofiled})
            rows += [[dtype, kind, name, f"{ms:.2f}", f"{100 * ms / total:.0f}%"] for name, ms in parts.items()]
            timed.append([dtype, kind, *(f"{unprofiled[way]:.1f}" for way in ("one by one", "one call")),
                          f"{unprofiled['one by one'] / unprofiled['one call']:.2f}x"])
    print_table(["dtype", "step", "part", "ms/step", "share"], rows)
    print_table(["dtype", "step", "ms/step, layers one by one", "in one call", "speed-up"], timed)
    if not args.quick:
        save_json("profile", {"machine": machine(), "command": "python bench/profile_step.py", "prompt_tokens":
                              len(prompt), "max_new_tokens": args.tokens, "records": records})


if __name__ == "__main__":
    main()
