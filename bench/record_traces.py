"""Record the steps the real default model (SmolLM2-135M-Instruct) takes, for `bench/first_run.py` part (b) to replay
on a GPU with a SmolLM2-shaped model of random weights (no model file has to travel).

One prompt of each kind of bench/data/dev.jsonl, greedy, `--tokens` new tokens, each setting's full-size steps
(`budget="fixed"`, cold drafting: what a step costs depends only on its shape, what it commits on the real model's
drafts). Per generation: the prompt's length, and per decoding step its pattern (W, N, tree), the logits rows and
top-k it asked for, and the step indices it committed. Plain decoding needs no trace: one token a step.

    python bench/record_traces.py       # writes bench/data/smollm2-traces.json (about 2 minutes on 2 CPU cores)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from compression import parse_setting  # noqa: E402

from common import ROOT, chat_ids, load_model, load_prompts  # noqa: E402
from lookahead.models.runner import CachedRunner  # noqa: E402

TRACES = ROOT / "bench" / "data" / "smollm2-traces.json"
SETTINGS = ("1-4-5", "7-5-7")  # the package default's shape (T = 18); a deeper one (T = 56) a GPU runs nearly free


class StepLog:
    """Records every decoding step and commit of the runners while installed (`CachedRunner.step` and `.commit`
    wrapped): [{"W", "N", "tree_end", "rows", "topk", "commit"}]."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._saved = None

    def __enter__(self):
        self._saved = step, commit = CachedRunner.step, CachedRunner.commit
        log, pending = self, {}

        def logged_step(runner, steps):
            for s in steps:
                if not s.prefill:
                    p = s.pattern
                    pending[s.row] = {"W": p.window, "N": p.ngram, "tree_end": list(p.tree_end or ()),
                                      "rows": list(s.rows), "topk": s.topk}
            return step(runner, steps)

        def logged_commit(runner, row, step_indices):
            if row in pending:
                log.steps.append({**pending.pop(row), "commit": list(step_indices)})
            return commit(runner, row, step_indices)

        CachedRunner.step, CachedRunner.commit = logged_step, logged_commit
        return self

    def __exit__(self, *exc):
        CachedRunner.step, CachedRunner.commit = self._saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=TRACES)
    args = parser.parse_args()
    folder, model, tokenizer = load_model()
    prompts = [(row["kind"], chat_ids(tokenizer, row["prompt"])) for row in load_prompts(1)]
    config = json.loads((folder / "config.json").read_text())  # the checkpoint's: `LlamaConfig.from_dict` reads it
    traces = []
    for setting in SETTINGS:
        cfg = parse_setting(setting)
        for kind, ids in prompts:
            model.runner and model.runner.clear_cache()
            with StepLog() as log:
                result = model.generate(ids, max_new_tokens=args.tokens, lookahead=cfg, eos_token_id=[])
            committed = sum(len(s["commit"]) for s in log.steps)
            traces.append({"setting": setting, "kind": kind, "prompt_len": len(ids), "new_tokens": len(result.tokens),
                           "steps": log.steps})
            print(f"{setting} {kind}: prompt {len(ids)}, {len(result.tokens)} tokens in {len(log.steps)} steps "
                  f"(S {committed / max(1, len(log.steps)):.2f})", flush=True)
    payload = {"model": "SmolLM2-135M-Instruct", "config": config, "device": "cpu", "dtype": str(model.dtype),
               "command": "python bench/record_traces.py" + (f" --tokens {args.tokens}" if args.tokens != 96 else ""),
               "traces": traces}
    args.out.write_text(json.dumps(payload, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
