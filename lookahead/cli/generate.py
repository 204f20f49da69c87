"""The work of `lookahead generate`: load the checkpoint and its tokenizer, generate, stream the text.

The command's front (argument parsing and checks, the environment, error handling) is the top-level
module `lookahead.cli`, which runs before torch is imported and calls `run` with checked arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path

from lookahead.config import LookaheadConfig

from .launch import remove_empty_log_dir, world_size
from .report import (
    Notes,
    Timed,
    comparison,
    decoding_rate,
    dtype_choice,
    dtype_name,
    pass_cost,
    peer_rates,
    probe_plain,
    summary,
    whole_answer_rate,
    why_plain,
    why_slower,
)

_COLORS = ("\033[38;5;39m", "\033[38;5;208m")  # alternate per multi-token step, like the authors' demo
_RESET = "\033[0m"
# --show-steps off a terminal: brackets no programming language uses (square brackets mangled code: s[[::-1]])
STEP_MARKS = ("\u27e6", "\u27e7")
ASCII_STEP_MARKS = ("<|", "|>")  # where stdout cannot encode those
# torchrun starts every process at once, so they meet within seconds; a process that waits longer has no peers
JOIN_TIMEOUT = timedelta(seconds=60)
JOIN_NOTICE_S = 3.0  # a wait longer than this is said on stderr, with what it waits for
GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waiting longer (a peer died or hangs) ends the run with an error


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    """Generate for `lookahead.cli`'s checked arguments; errors are raised for the front to print.

    environ: where torchrun's WORLD_SIZE, RANK, LOCAL_RANK are read from (WORLD_SIZE > 1: lookahead parallelism;
    `lookahead.cli.launch.world_size` tells a torchrun launch from a stray WORLD_SIZE)."""
    world = world_size(environ)
    if world <= 1:
        return _run(args, None, _say)
    import torch
    import torch.distributed as dist

    if args.compare:
        raise ValueError(f"--compare under torchrun ({world} processes): compare plain and lookahead decoding in one "
                         "process")
    if args.no_lookahead:
        raise ValueError(f"--no-lookahead under torchrun ({world} processes): lookahead parallelism divides lookahead "
                         "steps among the processes; run plain decoding in one process")
    device = _device(torch, args.device)
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda") and args.device in (None, "cuda"):
        device = f"cuda:{local_rank}"  # one GPU per process
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)  # before NCCL starts, so its communicator is made on this rank's GPU
    store, rank = _join(dist, environ, world)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT, device_id=torch.device(device) if cuda else None)
    try:
        say = _say if rank == 0 else (lambda message: None)
        code = _run(args, (dist.group.WORLD, world, rank, device), say)
    finally:
        dist.destroy_process_group()
    if local_rank == 0:
        remove_empty_log_dir(environ)
    return code


def _join(dist, environ: Mapping[str, str], world: int):
    """Meet the other processes of the launch within JOIN_TIMEOUT; returns the rendezvous store and this rank.

    Says what it waits for when that takes more than a few seconds. While it waits in torch's C++ code, Python's
    signal handlers cannot run, so SIGINT and SIGTERM get their default action (end the process) meanwhile."""
    where = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    seconds = int(JOIN_TIMEOUT.total_seconds())
    notice = threading.Timer(JOIN_NOTICE_S, _say, [
        f"waiting for the {world} processes of WORLD_SIZE={world} to meet at {where} (torchrun); giving up after "
        f"{seconds} s; Ctrl-C ends it"])
    notice.daemon = True
    with _default_signals():
        notice.start()
        try:
            # env:// reads the same variables from os.environ; under torchrun it joins torchrun's own store
            store, rank, _ = next(dist.rendezvous("env://", timeout=JOIN_TIMEOUT))
            store.set_timeout(JOIN_TIMEOUT)
            # a client of torchrun's store connects at once: count the arrivals to know that every process is here
            key = f"lookahead/joined/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            if store.add(key, 1) == world:
                store.set(f"{key}/all", "1")
            store.wait([f"{key}/all"])
        except RuntimeError as e:  # torch's DistStoreError, DistNetworkError: a timeout or no connection
            message = " ".join(str(e).split())
            raise TimeoutError(f"WORLD_SIZE={world}: the {world} processes did not meet at {where} within {seconds} s "
                               f"({message}); start them with 'torchrun --nproc-per-node {world} -m lookahead "
                               "generate ...', or unset WORLD_SIZE to run one process") from None
        finally:
            notice.cancel()
    store.set_timeout(GROUP_TIMEOUT)
    return store, rank


@contextlib.contextmanager
def _default_signals() -> Iterator[None]:
    """SIGINT and SIGTERM end the process at once inside (no Python handler runs), then are restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def load(args: argparse.Namespace, parallel, say):
    """The model, its tokenizer and the lookahead configuration the checked arguments ask for (parallel: None, or
    (group, K, rank, device) under torchrun, where the default W and G scale with K)."""
    say(f"loading torch and {args.model or 'the default model'} ...")
    start = time.perf_counter()
    import torch

    from lookahead.models import Llama, default_model_dir

    ranks = 1 if parallel is None else parallel[1]
    scaled = LookaheadConfig().scaled(ranks)  # strong scaling over the ranks (docs/parallelism.md)
    window = args.window if args.window is not None else scaled.window
    guesses = args.guesses if args.guesses is not None else scaled.guesses
    budget = "fixed" if args.fixed_steps or ranks > 1 else "auto"  # lookahead parallelism divides full steps
    lookahead = None if args.no_lookahead else LookaheadConfig(window, args.ngram, guesses, budget=budget)
    device = _device(torch, args.device) if parallel is None else parallel[3]
    backend = _backend(args.attn_backend, device)
    folder = args.model if args.model else default_model_dir(args.cache_dir)
    model = Llama.from_pretrained(folder, dtype=args.dtype, device=device, attn_backend=backend,
                                  fusion=args.fusion, batch_invariant=args.batch_invariant)
    if model.uses_cpu_kernels:  # the mode's packed weights become the one copy: nothing here reads the others
        model.keep_weights_once()
    tokenizer = _tokenizer(folder)
    dtype = dtype_name(model)
    mode = ", batch-invariant" if model.batch_invariant else ""
    say(f"loaded in {time.perf_counter() - start:.1f} s ({dtype}, {device}{mode}); generating"
        + ("" if parallel is None else f" on {ranks} processes (lookahead parallelism)"))
    if dtype_choice(model) is not None:
        say(dtype_choice(model))
    if dtype != "float32" and lookahead is not None and args.temperature == 0 and not model.batch_invariant:
        say(f"note: in {dtype} the output may differ from plain greedy decoding where two tokens are "
             "nearly tied (a multi-token pass rounds differently from a one-token pass); float32 is token-exact, "
             "and so is every dtype with --batch-invariant")
    return model, tokenizer, lookahead


def generate_kwargs(args: argparse.Namespace, lookahead) -> dict:
    """`Llama.generate`'s decoding arguments from the checked flags."""
    return dict(max_new_tokens=args.max_new_tokens, lookahead=lookahead, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _run(args: argparse.Namespace, parallel, say) -> int:
    model, tokenizer, lookahead = load(args, parallel, say)
    prompt_ids = encode(tokenizer, [{"role": "user", "content": args.prompt}], raw=args.raw)
    if args.compare:
        return _compare(args, model, tokenizer, lookahead, prompt_ids)
    printing = parallel is None or parallel[2] == 0
    if parallel is None:  # plain too: a cold answer's rate held its first call's costs (its prefill 4x), not a probe's
        _prepare(model, lookahead, len(prompt_ids) + args.max_new_tokens, args.temperature > 0, say)
    printer = StreamPrinter(tokenizer, args.show_steps, color=sys.stdout.isatty()) if printing else None
    stamps: list[float] = []  # when each token arrived: the answer's decoding rate, timed as plain's is
    start = time.perf_counter()
    result = model.generate(prompt_ids, **generate_kwargs(args, lookahead),
                            stream=_stamped(printer, stamps) if printing else None,
                            process_group=None if parallel is None else parallel[0])
    run = Timed(result, time.perf_counter() - start)
    if not printing:
        return 0
    print(flush=True)
    rate, why = baseline(model, run, lookahead, prompt_ids, parallel is not None)
    if lookahead is not None:
        passes = pass_cost(model, result, len(prompt_ids))[1]
        why = why_slower(result, decoding_rate(result, stamps), rate, why, passes) or why
        rate = whole_answer_rate(rate, len(result.tokens), stamps[0] - start if stamps else None)  # as the line times
    dtype = dtype_name(model)
    print(summary(run, lookahead, 1 if parallel is None else parallel[1], Notes(dtype, rate, peer_rates(dtype), why)),
          file=sys.stderr)
    return 0


def _stamped(stream, stamps: list[float]):
    """`stream`, noting when each token arrives."""
    def note(tokens: list[int]) -> None:
        stamps.extend([time.perf_counter()] * len(tokens))
        if stream is not None:
            stream(tokens)
    return note


def _prepare(model, lookahead, positions: int, sampling: bool, say) -> None:
    """Before an answer is timed: its KV cache, the first call's one-time costs, and the machine's step costs
    measured if no cost file has them yet (a few seconds, once), so the summary's tokens/s is the answer's, not the
    measurement's, and a plain answer's is what the probe beside a lookahead answer times (`baseline`)."""
    before = model.measuring_seconds
    model.warmup(lookahead, max_tokens=max(2, min(positions, model.config.max_position_embeddings)), sampling=sampling)
    seconds = model.measuring_seconds - before  # only what was measured now: a cost file read is no measurement
    if seconds > 0:
        say(f"measured this machine's step costs in {seconds:.1f} s (once per machine and model)")


def baseline(model, run: Timed, lookahead, prompt_ids: list[int], parallel: bool = False):
    """(plain decoding's tokens/s here, why self-tuned steps stayed plain or None): a plain run's own rate; a lookahead
    run's, a short plain continuation timed now (`probe_plain`), the loop's own work in it. Not the cost model's rate:
    that is the forward pass alone, measured once, and was 1.1-2.9x above what plain decoding then did (issue 49)."""
    if lookahead is None:
        return run.rate, None
    why = why_plain(model, run.result, len(prompt_ids)) if lookahead.budget == "auto" and not parallel else None
    try:
        return probe_plain(model, prompt_ids), why
    except ValueError:  # the prompt leaves no room for the probe's tokens in the model's positions
        return None, why


def _compare(args: argparse.Namespace, model, tokenizer, lookahead, prompt_ids: list[int]) -> int:
    """`--compare` (one process: refused under torchrun): plain decoding, then lookahead decoding (streamed), each
    prefilling the whole prompt, after one load and a warm-up (the self-tuned cost model is measured there, not inside
    the lookahead run's time); both summaries, then lookahead's tokens/s over plain decoding's."""
    _prepare(model, lookahead, len(prompt_ids) + args.max_new_tokens, args.temperature > 0, _say)
    _say("plain decoding first, timed for the comparison (its text is not shown) ...")
    timed = []
    for config in (None, lookahead):
        if model.runner is not None:
            model.runner.clear_cache()  # each run prefills the whole prompt: neither resumes the other's
        printer = None if config is None else StreamPrinter(tokenizer, args.show_steps, color=sys.stdout.isatty())
        start = time.perf_counter()
        result = model.generate(prompt_ids, **{**generate_kwargs(args, lookahead), "lookahead": config},
                                stream=printer)
        timed.append(Timed(result, time.perf_counter() - start))
    plain, ahead = timed
    print(flush=True)
    dtype = dtype_name(model)
    print(summary(plain, notes=Notes(dtype)), file=sys.stderr)
    why = why_plain(model, ahead.result, len(prompt_ids))
    print(summary(ahead, lookahead, notes=Notes(dtype, peers=peer_rates(dtype), why=why)), file=sys.stderr)
    exact = args.temperature == 0 or args.seed is not None
    passes = pass_cost(model, ahead.result, len(prompt_ids))[1]
    print(comparison(plain, ahead, exact, why, passes), file=sys.stderr)
    return 0


def _say(message: str) -> None:
    print(f"lookahead: {message}", file=sys.stderr, flush=True)


def _device(torch, requested: str | None) -> str:
    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {requested}: {why} (torch {torch.__version__}); use --device cpu")
    return requested


def _backend(requested: str, device: str) -> str:
    from lookahead.backends import choose_backend
    from lookahead.kernels import interpreting

    chosen = choose_backend(requested, device.split(":")[0], interpreting())
    if chosen == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"--attn-backend {requested} on {device} needs the triton package (pip install triton, "
                         "or pip install -e '.[triton]'); or pass --attn-backend torch")
    return chosen


def _tokenizer(folder):
    """The checkpoint's tokenizer: a folder's files, or a GGUF file's own (with its chat template)."""
    from transformers import AutoTokenizer

    from lookahead.models.gguf import gguf_file, gguf_tokenizer

    try:
        gguf = gguf_file(Path(folder))
        return gguf_tokenizer(gguf) if gguf is not None else AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from None


def encode(tokenizer, messages: list[dict], raw: bool = False) -> list[int]:
    """The conversation's token ids, ready for the next answer (raw: the one message's text as it is)."""
    if raw:
        return tokenizer(messages[-1]["content"], add_special_tokens=True)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template; pass --raw to feed the prompt as is")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


class StreamPrinter:
    """Prints the text of each step's tokens as it arrives; with show_steps, marks the text of each multi-token step:
    alternating colours on a terminal (color), else STEP_MARKS around it (ASCII_STEP_MARKS where stdout cannot
    encode those)."""

    def __init__(self, tokenizer, show_steps: bool, color: bool) -> None:
        self.tokenizer, self.show_steps, self.color = tokenizer, show_steps, color
        self.marks = _marks(sys.stdout)
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
            new = (_COLORS[self.groups % 2] + new + _RESET) if self.color else self.marks[0] + new + self.marks[1]
        sys.stdout.write(new)
        sys.stdout.flush()


def _marks(stream) -> tuple[str, str]:
    try:
        "".join(STEP_MARKS).encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return ASCII_STEP_MARKS
    return STEP_MARKS
