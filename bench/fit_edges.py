"""Fits the edge model's weights (`lookahead/drafts/edges.py`) to the acceptance observed on the dev prompts.

Runs the dev prompts warm, in a stream on one model (greedy), and logs every offered edge of every step: each child
offered under the input token or under a node of the tree, with its state (`edges`: one per source), and whether it
is the model's argmax there (the step computes the output of every node, so every offered child is labelled, taken
into the tree or not). Then fits, by maximum likelihood, the chosen weights of the logistic model additive in the
sources (by default the memory states'), the others held as they are. Prints them in the form `edges.py` takes;
saves the edge counts and the fit.

    python bench/fit_edges.py --per-kind 3 --max-new-tokens 128
    python bench/fit_edges.py --per-kind 3 --max-new-tokens 256 --fit suffix memory-suffix   # the match bands
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from compression import parse_setting

import lookahead.drafts.builder as builder
import lookahead.drafts.edges as edges
from common import chat_ids, load_model, load_prompts, machine, print_table, save_json
from lookahead.drafts.tree import ROOT, preorder
from lookahead.loop import LookaheadLoop

OWN = {"recycle": 11, "suffix": 11, "pool": 3}  # own states of each source (then the memory's)


class _Tagged(float):
    """A probability that remembers its edge state: what the builder's offered lists hold during the fit's run."""

    code: int


def _tagged(probability: float, code: int) -> _Tagged:
    out = _Tagged(probability)
    out.code = code
    return out


class EdgeLog:
    """Counts (offered, right) per edge state, from the builder's offered lists and the step's argmax."""

    def __init__(self) -> None:
        self.counts: dict[int, list[int]] = {}
        self.offered: list[list] = []  # per `_children` call of the build: call 0 the root, call 1 + n node n
        self.order: dict[int, int] = {}  # node as grown -> its pre-order index

    def install(self) -> None:
        builder.EDGE_PROBABILITY = [_tagged(p, c) for c, p in enumerate(edges.EDGE_PROBABILITY)]
        builder._RANKED_PROBABILITY = [[builder.EDGE_PROBABILITY[s] for s in states] for states in builder._RANKED]
        children, grown, grow, finish = (builder.DraftBuilder._children, builder.DraftTree.grown,
                                         builder.DraftBuilder.grow, LookaheadLoop.finish)
        log = self

        def logged_grow(self, *args, **kwargs):
            log.offered, log.order = [], {}
            return grow(self, *args, **kwargs)

        def logged_children(self, *args):
            out = children(self, *args)
            log.offered.append(out)
            return out

        def logged_grown(tokens, parents):
            below: dict[int, list[int]] = {}
            for node, parent in enumerate(parents):
                below.setdefault(parent, []).append(node)
            log.order = {old: new for new, old in enumerate(preorder(below, ROOT)[0])}
            return grown(tokens, parents)

        def logged_finish(self, layout, output):
            log.step(layout, output)
            return finish(self, layout, output)

        builder.DraftBuilder.grow, builder.DraftBuilder._children = logged_grow, logged_children
        builder.DraftTree.grown, LookaheadLoop.finish = staticmethod(logged_grown), logged_finish

    def step(self, layout, output) -> None:
        slots = layout.slot_rows
        for call, offered in enumerate(self.offered):
            slot = 0 if call == 0 else 1 + self.order[call - 1]
            right = output.argmax[slots[slot]]
            for probability, child, _ in offered:
                cell = self.counts.setdefault(probability.code, [0, 0])
                cell[0] += 1
                cell[1] += child == right


GROUPS = ("recycle", "suffix", "pool", "memory-recycle", "memory-suffix", "memory-pool")


def fit(counts: dict[int, list[int]], groups: tuple[str, ...]) -> dict[str, list[float]]:
    """The weights of `groups` (a source's own states, or the memory's: `GROUPS`), the others held, by maximum
    likelihood with a weak pull towards where they start (the weights in `edges.py` now)."""
    current = {"recycle": edges.RECYCLE_WEIGHTS, "suffix": edges.SUFFIX_WEIGHTS, "pool": edges.POOL_WEIGHTS}
    sizes = {name: len(weights) for name, weights in current.items()}
    start = {name: torch.tensor(weights, dtype=torch.float64) for name, weights in current.items()}
    free = {name: (torch.arange(sizes[name]) < OWN[name]) & (name in groups)
            | (torch.arange(sizes[name]) >= OWN[name]) & (f"memory-{name}" in groups) for name in sizes}
    params = {name: start[name].clone().requires_grad_() for name in sizes}
    codes = torch.tensor(sorted(counts))
    n = torch.tensor([counts[c][0] for c in codes.tolist()], dtype=torch.float64)
    k = torch.tensor([counts[c][1] for c in codes.tolist()], dtype=torch.float64)
    r, s = codes // (sizes["suffix"] * sizes["pool"]), codes // sizes["pool"] % sizes["suffix"]
    p = codes % sizes["pool"]
    optimizer = torch.optim.LBFGS(list(params.values()), max_iter=500, line_search_fn="strong_wolfe")

    def weights(name):
        return torch.where(free[name], params[name], start[name])

    def loss():
        optimizer.zero_grad()
        logit = weights("recycle")[r] + weights("suffix")[s] + weights("pool")[p]
        nll = -(k * torch.nn.functional.logsigmoid(logit) + (n - k) * torch.nn.functional.logsigmoid(-logit)).sum()
        pull = sum(((params[name] - start[name])[free[name]] ** 2).sum() for name in sizes)
        value = nll + pull
        value.backward()
        return value

    optimizer.step(loss)
    return {name: [round(float(w), 2) for w in weights(name).detach()] for name in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=3, help="prompts of each kind (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--config", default="1-4-5")
    parser.add_argument("--fit", nargs="+", default=list(GROUPS[3:]), choices=GROUPS,
                        help="the weights fitted, the rest held (default: the memory's)")
    parser.add_argument("--name", default="fit-edges")
    args = parser.parse_args()
    config = dataclasses.replace(parse_setting(args.config), budget="fixed", warm=True)
    _, model, tokenizer = load_model(args.model)
    log = EdgeLog()
    log.install()
    rows = load_prompts(args.per_kind or None)
    with torch.inference_mode():
        for i, row in enumerate(rows):
            result = model.generate(chat_ids(tokenizer, row["prompt"]), max_new_tokens=args.max_new_tokens,
                                    lookahead=config)
            print(f"[{i + 1}/{len(rows)}] {row['id']}: S {result.compression:.2f}", flush=True)
    weights = fit(log.counts, tuple(args.fit))
    table = []
    for code, (offered, right) in sorted(log.counts.items(), key=lambda kv: -kv[1][0])[:25]:
        table.append([code, offered, f"{right / offered:.3f}", f"{edges.EDGE_PROBABILITY[code]:.3f}"])
    print_table(["state", "offered", "right", "model"], table)
    for name, values in weights.items():
        print(f"{name}: {tuple(values[:OWN[name]])}\nmemory {name}: {tuple(values[OWN[name]:])}")
    print(save_json(args.name, {"machine": machine(), "config": args.config, "max_new_tokens": args.max_new_tokens,
                                "prompts": [r["id"] for r in rows], "fitted": args.fit, "counts": log.counts,
                                "memory_weights": {name: values[OWN[name]:] for name, values in weights.items()},
                                "weights": weights}))


if __name__ == "__main__":
    main()
