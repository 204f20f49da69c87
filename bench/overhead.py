"""Per-step host cost of the decode loop: wall time of `decode` minus the time inside the model's calls, and
within it the time spent drafting (the tree form's sources and tree building) and packing, and learning
from a verified step (recording the rows' top-k for recycling), as wall time and as the thread's CPU time.

The loop's own work per step (window, pool, drafts, argmax and verification, commit bookkeeping) should stay
small next to the forward pass and must not grow with the sequence.

    python bench/overhead.py --max-new-tokens 256 --configs 15-5-15 3-4-3 15-5-15:chains
"""

from __future__ import annotations

import argparse
import time

import torch
from compression import parse_setting

from common import chat_ids, load_model, load_prompts, machine, print_table, save_json, sync
from lookahead import Request, decode
from lookahead.drafts import DraftBuilder
from lookahead.loop import LookaheadLoop
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

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        self.seconds += time.perf_counter() - start
        return out

    def prefill(self, tokens):
        return self._timed(self.inner.prefill, tokens)

    def step(self, tokens, pattern, rows, **kwargs):
        start = time.perf_counter()
        self.marks.append((start, self.seconds))
        out = self._timed(self.inner.step, tokens, pattern, rows, **kwargs)
        self.step_seconds.append(time.perf_counter() - start)
        return out

    def commit(self, indices):
        return self._timed(self.inner.commit, indices)


class Stopwatch:
    """Seconds spent in some functions, patched over the class attributes that hold them: wall time, and the
    calling thread's CPU time, which a shared machine's other processes do not inflate (the host work is
    single-threaded Python, so on an idle machine the two agree)."""

    def __init__(self, targets: dict[str, tuple[type, str]]) -> None:
        self.seconds = dict.fromkeys(targets, 0.0)
        self.cpu_seconds = dict.fromkeys(targets, 0.0)
        self._saved = []
        for name, (owner, attribute) in targets.items():
            original = getattr(owner, attribute)
            self._saved.append((owner, attribute, original))
            setattr(owner, attribute, self._wrap(name, original))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.cpu_seconds[name] += time.thread_time() - cpu
        return timed

    def restore(self) -> None:
        for owner, attribute, original in self._saved:
            setattr(owner, attribute, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--kind", default="code", help="which kind of dev prompt to run (the first of it)")
    parser.add_argument("--configs", nargs="*", default=["15-5-15", "3-4-3", "15-5-15:chains", "3-4-3:chains"])
    args = parser.parse_args()
    folder, model, tokenizer = load_model(args.model)
    ids = chat_ids(tokenizer, load_prompts(1, (args.kind,))[0]["prompt"])
    rows = []
    with torch.inference_mode():
        for spec in args.configs:
            cfg = parse_setting(spec)
            request = Request([ids], args.max_new_tokens, lookahead=cfg, static_step=model.device.type == "cuda")
            timed = TimedModel(runner_for(model, request))
            watch = Stopwatch({"plan": (LookaheadLoop, "plan"), "draft": (DraftBuilder, "build"),
                               "finish": (LookaheadLoop, "finish"), "learn": (LookaheadLoop, "_learn")})
            start = time.perf_counter()
            try:
                result = decode(timed, request)
            finally:
                watch.restore()
            total = time.perf_counter() - start
            steps = result.steps - 1  # the prefill is no lookahead step
            loop_us = (total - timed.seconds) / steps * 1e6
            model_ms = sum(timed.step_seconds) / len(timed.step_seconds) * 1e3
            half = len(timed.marks) // 2
            per_step = {f"{name}_us": s / steps * 1e6 for name, s in watch.seconds.items()}
            per_step.update({f"{name}_cpu_us": s / steps * 1e6 for name, s in watch.cpu_seconds.items()})
            rows.append({"config": spec, "steps": result.steps, "S": result.compression, "loop_us_per_step": loop_us,
                         **per_step, "model_ms_per_step": model_ms,
                         "loop_share": loop_us / 1e3 / (model_ms + loop_us / 1e3),
                         "loop_us_first_half": timed.loop_us(slice(0, half + 1)),
                         "loop_us_second_half": timed.loop_us(slice(half, None))})
    print(f"decode loop host cost per step, {args.max_new_tokens} tokens, one {args.kind} prompt, "
          f"{machine()['device']}")
    parts = ("plan", "draft", "finish", "learn")
    print_table(["setting", "steps", "S", "loop us", "plan us", "(draft us)", "finish us", "(learn us)",
                 "CPU: plan / draft / finish / learn us", "1st half", "2nd half", "model ms", "loop share"],
                [[r["config"], r["steps"], f"{r['S']:.2f}", f"{r['loop_us_per_step']:.0f}",
                  *(f"{r[f'{part}_us']:.0f}" for part in parts),
                  " / ".join(f"{r[f'{part}_cpu_us']:.0f}" for part in parts),
                  f"{r['loop_us_first_half']:.0f}", f"{r['loop_us_second_half']:.0f}",
                  f"{r['model_ms_per_step']:.1f}", f"{r['loop_share']:.1%}"] for r in rows])
    print(save_json("overhead", {"machine": machine(), "max_new_tokens": args.max_new_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
