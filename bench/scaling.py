"""The scaling law (paper Fig. 4, blog Fig. 6) and the ablations of the paper's Table 3, on the default model.

Scaling: S (tokens / forward passes) for the same greedy output as W grows (1, 2, 4, 8, 16, 32) for
N in {3, 5, 7, 11}, G = W, plotted against log W. Ablations: prompt as reference on/off, G = 1 with a
large W, W = 1 with a large G, balanced. Only forward passes are counted here, so CPU speed does not
matter; every run is checked token for token against plain greedy.

    python bench/scaling.py --per-kind 1 --max-new-tokens 96
"""

from __future__ import annotations

import argparse

import torch

from common import chat_ids, load_model, load_prompts, machine, print_table, save_json
from lookahead import LookaheadConfig

WINDOWS = (1, 2, 4, 8, 16, 32)
NGRAMS = (3, 5, 7, 11)
# (label, N, W, G, prompt as reference, output as reference): the paper's Table 3 rows, ours last
ABLATIONS = [
    ("(10,1,3) prompt", 10, 1, 3, True, False),
    ("(5,1,10) prompt", 5, 1, 10, True, False),
    ("(5,1,30) no prompt", 5, 1, 30, False, False),
    ("(5,1,30) prompt", 5, 1, 30, True, False),
    ("(5,30,1) no prompt", 5, 30, 1, False, False),
    ("(5,15,15) no prompt", 5, 15, 15, False, False),
    ("(5,15,15) prompt", 5, 15, 15, True, False),
    ("(5,15,15) prompt+output", 5, 15, 15, True, True),
]


def compression(model, prompts, references, cfg: LookaheadConfig, max_new_tokens: int) -> tuple[float, int]:
    """(S over all prompts, outputs identical to plain greedy)."""
    tokens = steps = exact = 0
    for ids, reference in zip(prompts, references, strict=True):
        result = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=cfg)
        tokens, steps = tokens + len(result.tokens), steps + result.steps
        exact += result.tokens == reference
    return tokens / steps, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the converted default model)")
    parser.add_argument("--per-kind", type=int, default=1)
    parser.add_argument("--kinds", nargs="*", default=["chat", "code", "math"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--windows", type=int, nargs="*", default=list(WINDOWS))
    parser.add_argument("--ngrams", type=int, nargs="*", default=list(NGRAMS))
    args = parser.parse_args()

    folder, model, tokenizer = load_model(args.model)
    rows = load_prompts(args.per_kind, tuple(args.kinds))
    prompts = [chat_ids(tokenizer, r["prompt"]) for r in rows]
    with torch.inference_mode():
        references = [model.generate(ids, max_new_tokens=args.max_new_tokens).tokens for ids in prompts]
        scaling = []
        for n in args.ngrams:
            for w in args.windows:
                s, exact = compression(model, prompts, references, LookaheadConfig(w, n, w), args.max_new_tokens)
                scaling.append({"N": n, "W": w, "G": w, "S": s, "exact": exact})
                print(f"N={n} W=G={w}: S={s:.2f} exact {exact}/{len(prompts)}", flush=True)
        ablations = []
        for label, n, w, g, from_prompt, from_output in ABLATIONS:
            cfg = LookaheadConfig(w, n, g, pool_from_prompt=from_prompt, pool_from_output=from_output)
            s, exact = compression(model, prompts, references, cfg, args.max_new_tokens)
            ablations.append({"setting": label, "S": s, "exact": exact})
            print(f"{label}: S={s:.2f} exact {exact}/{len(prompts)}", flush=True)

    print(f"\nscaling ({len(prompts)} prompts, {args.max_new_tokens} tokens): S by N (rows) and W = G (columns)")
    print_table(["N"] + [f"W={w}" for w in args.windows],
                [[n] + [f"{r['S']:.2f}" for r in scaling if r["N"] == n] for n in args.ngrams])
    print("\nablations (paper Table 3 settings, (N, W, G))")
    print_table(["setting", "S", "exact"], [[a["setting"], f"{a['S']:.2f}", f"{a['exact']}/{len(prompts)}"]
                                             for a in ablations])
    path = save_json("scaling", {"machine": machine(), "prompts": [r["id"] for r in rows],
                                 "max_new_tokens": args.max_new_tokens, "scaling": scaling, "ablations": ablations})
    plot(scaling, args.ngrams, path.with_suffix(".png"))
    print(f"\nsaved {path} and {path.with_suffix('.png')}")


def plot(scaling, ngrams, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for n in ngrams:
        points = [r for r in scaling if r["N"] == n]
        ax.plot([r["W"] for r in points], [r["S"] for r in points], marker="o", label=f"N={n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window W (= G), log scale")
    ax.set_ylabel("S = tokens / decoding steps")
    ax.set_title("Lookahead scaling: same output, fewer steps as W grows")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
