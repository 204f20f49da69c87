"""How fast three grammar engines compile a JSON schema and compute a token mask on this CPU, with the default model's
tokenizer (SmolLM2's byte-level BPE, 49,152 tokens): llguidance, xgrammar and outlines-core. What chose the server's
engine (docs/DESIGN.md, "Structured outputs").

For each engine and each schema of bench/data/structured.json: the compile time (tokenizer set-up apart, once per
engine), then a walk along the tokens of a document valid under the schema, timing the mask at every position (the
engine's own bitmask fill) and the token's consumption. Prints a table and saves bench/results/grammar-masks-cpu.json.

    python bench/grammar_masks.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import machine, save_json

DATA = Path(__file__).resolve().parent / "data" / "structured.json"


def _documents() -> list[tuple[str, dict, str]]:
    cases = json.loads(DATA.read_text(encoding="utf-8"))["prompts"]
    return [(case["name"], case["schema"], json.dumps(case["example"])) for case in cases if "example" in case]


def _llguidance(tokenizer, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile_(schema):
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(matcher):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def consume(matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    return compile_, mask, consume


def _xgrammar(tokenizer, vocab):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile_(schema):
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def mask(matcher):
        matcher.fill_next_token_bitmask(bitmask)

    def consume(matcher, token):
        assert matcher.accept_token(token)

    return compile_, mask, consume


def _outlines(tokenizer, vocab):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core takes the vocabulary as decoded strings (its own Vocabulary.from_pretrained reads the Hub)
    table: dict[str, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i != tokenizer.eos_token_id:
            table.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(i)
    vocabulary = Vocabulary(tokenizer.eos_token_id, table)
    bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile_(schema):
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

    def mask(guide):
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def consume(guide, token):
        guide.advance(token)

    return compile_, mask, consume


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="walks per schema (the masks' median over all)")
    parser.add_argument("--engines", nargs="*", default=list(ENGINES))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from lookahead.models.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = 49152
    rows = []
    for name in args.engines:
        start = time.perf_counter()
        compile_, mask, consume = ENGINES[name](tokenizer, vocab)
        setup_s = time.perf_counter() - start
        compiles, masks, consumes = [], [], []
        for _, schema, text in _documents():
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            for _ in range(args.repeat):
                start = time.perf_counter()
                matcher = compile_(schema)
                compiles.append(time.perf_counter() - start)
                for token in tokens:
                    start = time.perf_counter()
                    mask(matcher)
                    masks.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    consume(matcher, token)
                    consumes.append(time.perf_counter() - start)
        rows.append({"engine": name, "setup_s": setup_s, "compile_ms_median": 1e3 * statistics.median(compiles),
                     "compile_ms_max": 1e3 * max(compiles), "mask_us_median": 1e6 * statistics.median(masks),
                     "mask_us_p99": 1e6 * sorted(masks)[int(0.99 * (len(masks) - 1))],
                     "consume_us_median": 1e6 * statistics.median(consumes), "masks": len(masks)})
    print(f"{'engine':14} {'setup s':>8} {'compile ms':>11} {'(max)':>8} {'mask us':>8} {'p99':>8} {'consume us':>10}")
    for r in rows:
        print(f"{r['engine']:14} {r['setup_s']:8.2f} {r['compile_ms_median']:11.1f} {r['compile_ms_max']:8.1f} "
              f"{r['mask_us_median']:8.0f} {r['mask_us_p99']:8.0f} {r['consume_us_median']:10.1f}")
    command = f"python bench/grammar_masks.py --repeat {args.repeat}"
    save_json("grammar-masks", {"machine": machine(), "command": command, "vocab": vocab, "rows": rows})


if __name__ == "__main__":
    main()
