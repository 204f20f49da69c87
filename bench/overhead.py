"""Per-step overhead of the decode loop: wall time of `decode` minus the time inside the model's calls.

The loop's own work per step (window, pool, candidate lookup, argmax and verification, commit
bookkeeping) should stay small next to the forward pass and must not grow with the sequence.

    python bench/overhead.py --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import time

import torch

from common import chat_ids, load_model, load_prompts, machine, print_table, save_json, sync
from lookahead import LookaheadConfig, decode
from lookahead.models.generation import runner_for


class TimedModel:
    """Wraps a StepModel, adding up the seconds spent inside its calls (device work synchronised)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.step_seconds = inner, 0.0, []
        self.marks: list[tuple[float, float]] = []  # (wall clock, model seconds so far) at each step's start

    def loop_us(self, part: slice) -> float:
        """Mean microseconds per step spent outside the model, over the steps in `part`."""
        marks = self.marks[part]
        wall = marks[-1][0] - marks[0][0]
        inside = marks[-1][1] - marks[0][1]
        return (wall - inside) / (len(marks) - 1) * 1e6

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        sync()
        self.seconds += time.perf_counter() - start
        return out

    def prefill(self, tokens):
        return self._timed(self.inner.prefill, tokens)

    def step(self, tokens, pattern, rows):
        start = time.perf_counter()
        self.marks.append((start, self.seconds))
        out = self._timed(self.inner.step, tokens, pattern, rows)
        self.step_seconds.append(time.perf_counter() - start)
        return out

    def commit(self, indices):
        return self._timed(self.inner.commit, indices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--configs", nargs="*", default=["5-4-5", "7-5-7", "15-5-15"])
    args = parser.parse_args()
    folder, model, tokenizer = load_model(args.model)
    ids = chat_ids(tokenizer, load_prompts(1, ("code",))[0]["prompt"])
    rows = []
    with torch.inference_mode():
        for spec in args.configs:
            cfg = LookaheadConfig(*map(int, spec.split("-")))
            timed = TimedModel(runner_for(model, len(ids) + args.max_new_tokens, cfg, cuda_graph=True))
            start = time.perf_counter()
            result = decode(timed, ids, args.max_new_tokens, lookahead=cfg, eos_token_ids=(), device=model.device,
                            static_step=model.device.type == "cuda")
            total = time.perf_counter() - start
            loop_us = (total - timed.seconds) / result.steps * 1e6
            model_ms = sum(timed.step_seconds) / len(timed.step_seconds) * 1e3
            half = len(timed.marks) // 2
            rows.append({"config": spec, "steps": result.steps, "loop_us_per_step": loop_us,
                         "model_ms_per_step": model_ms, "loop_share": loop_us / 1e3 / (model_ms + loop_us / 1e3),
                         "loop_us_first_half": timed.loop_us(slice(0, half + 1)),
                         "loop_us_second_half": timed.loop_us(slice(half, None))})
    print(f"decode loop overhead, {args.max_new_tokens} tokens, {machine()['device']}")
    print_table(["W-N-G", "steps", "loop us/step", "1st half", "2nd half", "model ms/step", "loop share"],
                [[r["config"], r["steps"], f"{r['loop_us_per_step']:.0f}", f"{r['loop_us_first_half']:.0f}",
                  f"{r['loop_us_second_half']:.0f}", f"{r['model_ms_per_step']:.1f}", f"{r['loop_share']:.1%}"]
                 for r in rows])
    print(save_json("overhead", {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
