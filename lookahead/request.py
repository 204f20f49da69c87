"""`Request`: one generation request (prompts, limits, sampling, lookahead, stop tokens, seeds), checked once and
taken as it is by every driver (one prompt, a batch, several processes, the transformers adapter).

`Request(...)` checks and normalises what the drivers read; `parse_request` turns what a user hands to
`Llama.generate` or `lookahead.hf.generate` (its `GenerateArgs`, for a `Target`: the model, its device, the ranks) into
one, with messages that name the user's arguments. A prompt may come as transformers hands it over: a list of ints, a
1-D or [1, T] integer tensor (what `apply_chat_template(..., return_tensors="pt")` gives), or a `BatchEncoding` / dict
holding `input_ids` (and, optionally, an all-ones `attention_mask`). A batch is a list or tuple of prompts, each a
list of ints or a 1-D (or [1, T]) integer tensor; a flat list of ints is one prompt. Nothing here imports transformers.

A request is frozen and hashable, so the ranks of lookahead parallelism agree on it by hashing its `repr`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import LookaheadConfig

SEED_SPAN = 2**64  # seeds are ints in [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means off; top_p in (0, 1]."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class Request:
    """What to generate; checked on construction, read by the drivers without further checks.

    prompts: one or more prompts, each a non-empty sequence of token ids (stored as tuples).
    max_new_tokens: the most tokens generated per prompt. sampling: greedy by default.
    lookahead: None for plain decoding, else the configuration of every step (per row for a batch).
    stop: token ids that end a prompt's generation (the stop token is kept in the output).
    seeds: one per prompt (None: fresh randomness); an int s given for all gives prompt i the seed s + i (mod 2**64),
        so prompt i samples what it samples alone with seed s + i.
    static_step: pad every lookahead step to a static shape (the configuration's, or a self-tuned size's), and
        the runner pads a packed step to a few sizes (CUDA graphs).
    batch: whether the caller asked with a batch (so gets a list of results back).
    """

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    lookahead: LookaheadConfig | None = None
    stop: frozenset[int] = field(default_factory=frozenset)
    seeds: tuple[int | None, ...] | int | None = None
    static_step: bool = False
    batch: bool = False

    def __post_init__(self) -> None:
        prompts = tuple(tuple(p) for p in self.prompts)
        if not prompts or not all(prompts):
            raise ValueError("a request needs at least one prompt, each of at least one token")
        if not all(_is_int(t) and t >= 0 for p in prompts for t in p):
            raise TypeError("prompts must hold token ids (ints >= 0)")
        object.__setattr__(self, "prompts", prompts)
        limit = self.max_new_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.lookahead is not None and not isinstance(self.lookahead, LookaheadConfig):
            raise TypeError(f"lookahead must be None or a LookaheadConfig, got {self.lookahead!r}")
        object.__setattr__(self, "stop", frozenset(token_ids(tuple(self.stop), "eos_token_id")))
        object.__setattr__(self, "seeds", row_seeds(self.seeds, len(prompts)))
        for name in ("static_step", "batch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def longest(self) -> int:
        """Positions the longest prompt can reach: its length + max_new_tokens."""
        return max(map(len, self.prompts)) + self.max_new_tokens


@dataclass(frozen=True)
class GenerateArgs:
    """A `generate` call's request arguments as its caller gave them, unchecked: `parse_request` checks them, each
    error naming the argument (see `Llama.generate` for what each may be)."""

    max_new_tokens: Any
    lookahead: Any = None
    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    seed: Any = None
    eos_token_id: Any = None
    static_step: Any = None


@dataclass(frozen=True)
class Target:
    """What a request is checked against and resolved for: the model's vocabulary and positions, its stop tokens where
    the caller gives none, its device type ("auto" lookahead; static steps on CUDA), and the ranks of lookahead
    parallelism (None: one process)."""

    vocab_size: int
    max_positions: int
    default_eos: tuple[int, ...] = ()
    device_type: str = "cpu"
    ranks: int | None = None


def parse_request(prompt_ids: Any, args: GenerateArgs, target: Target, *, allow_batch: bool = True,
                  prompt_name: str = "prompt_ids") -> Request:
    """A user's `generate` arguments as a `Request`, every error naming the argument.

    args.lookahead: None, a LookaheadConfig or "auto" (`LookaheadConfig.auto` for the target's device type; with
    `target.ranks` (lookahead parallelism over that many processes) the default scaled by them, full-size steps).
    args.static_step None: on CUDA only (where steps are captured as CUDA graphs). args.eos_token_id None: the
    target's `default_eos`. allow_batch: whether `prompt_ids` may be a batch; prompt_name: what errors call it.
    """
    vocab_size, max_positions, ranks = target.vocab_size, target.max_positions, target.ranks
    max_new_tokens, lookahead, seed, static_step = args.max_new_tokens, args.lookahead, args.seed, args.static_step
    prompts = prompt_batch(prompt_ids, vocab_size, prompt_name) if allow_batch else None
    batch = prompts is not None
    if prompts is None:
        prompts = [prompt_tokens(prompt_ids, vocab_size, prompt_name)]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    for i, prompt in enumerate(prompts):
        check_context(len(prompt), max_new_tokens, max_positions, f"{prompt_name}[{i}]" if batch else "prompt",
                      f"max_position_embeddings ({max_positions})")
    if ranks is not None:
        if batch:
            raise ValueError("process_group: lookahead parallelism decodes one prompt; give one prompt, not a batch")
        if isinstance(lookahead, str) and lookahead == "auto":
            lookahead = LookaheadConfig(budget="fixed").scaled(ranks)
        elif not isinstance(lookahead, LookaheadConfig):
            raise ValueError(f"process_group: lookahead parallelism divides a lookahead step among the ranks; give a "
                             f"LookaheadConfig (it describes the whole step) or 'auto', got {lookahead!r}")
        elif lookahead.window < ranks:
            raise ValueError(f"lookahead parallelism over {ranks} ranks needs a window of at least one column per "
                             f"rank, got W={lookahead.window}; use W >= {ranks} (LookaheadConfig.scaled(K) scales "
                             "W and G with K)")
    if isinstance(lookahead, str) and lookahead == "auto":
        lookahead = LookaheadConfig.auto(target.device_type)
    elif lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise TypeError(f"lookahead must be None, 'auto' or a LookaheadConfig, got {lookahead!r}")
    if lookahead is not None and lookahead.tree_nodes > max_positions:  # its deepest draft is past every position
        raise ValueError(f"lookahead: W={lookahead.window}, N={lookahead.ngram}, G={lookahead.guesses} verifies up to "
                         f"G(N - 1) = {lookahead.tree_nodes} draft nodes a step, more than the model's "
                         f"max_position_embeddings ({max_positions}): no step of it could be held; lower N or G")
    if not batch and seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None for one prompt (a list of seeds is for a batch), got {seed!r}")
    if static_step is not None and not isinstance(static_step, bool):
        raise TypeError(f"static_step must be a bool or None, got {static_step!r}")
    static = target.device_type == "cuda" if static_step is None else static_step
    eos = args.eos_token_id
    stop = tuple(target.default_eos) if eos is None else token_ids(eos, "eos_token_id")
    return Request(tuple(map(tuple, prompts)), max_new_tokens, SamplingParams(args.temperature, args.top_k, args.top_p),
                   lookahead, frozenset(stop), seed, static, batch)


class ContextExceeded(ValueError):
    """A prompt and the new tokens asked after it need more positions than the model holds (`check_context`)."""


def room(prompt_tokens: int, positions: int) -> int:
    """The most new tokens a prompt of `prompt_tokens` tokens leaves in `positions` positions (every token of the
    prompt and of the answer takes one); below 1 where the prompt alone fills them."""
    return positions - prompt_tokens


def check_context(prompt_tokens: int, max_new_tokens: int, positions: int, prompt: str = "prompt",
                  held: str | None = None) -> None:
    """`ContextExceeded` unless a prompt of `prompt_tokens` tokens and `max_new_tokens` new tokens fit in `positions`
    positions (`room`): the one check of a request against its model's positions, which `parse_request` (so
    `Llama.generate` and `lookahead.hf.generate`), `Engine.submit`, `lookahead.hf.custom_generate` and the server (its
    400, in the OpenAI API's words) all make. `prompt`: what the message calls the prompt; `held`: what it calls the
    positions (default "N positions")."""
    if max_new_tokens > room(prompt_tokens, positions):
        held = held or f"{positions} positions"
        raise ContextExceeded(f"{prompt} ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = "
                              f"{prompt_tokens + max_new_tokens} exceeds the model's {held}; shorten the prompt or "
                              "lower max_new_tokens")


def check_stream(stream: Any) -> None:
    """A `stream` callback must be callable (or None)."""
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be callable or None, got {type(stream).__name__}")


def row_seeds(seed: Any, rows: int) -> tuple[int | None, ...]:
    """Each row's sampling seed: a list gives them as they are (one per row); an int s gives row i the seed
    s + i (mod 2**64); None draws fresh ones."""
    if seed is None:
        return (None,) * rows
    if _is_int(seed):
        if not 0 <= seed < SEED_SPAN:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        return tuple((seed + i) % SEED_SPAN for i in range(rows))
    if not isinstance(seed, (list, tuple)):
        raise TypeError(f"seed must be an int, a list of ints (one per prompt) or None, got {type(seed).__name__}")
    if len(seed) != rows:
        raise ValueError(f"seed holds {len(seed)} seeds for {rows} prompts; give one per prompt (or one int)")
    for i, s in enumerate(seed):
        if s is not None and (not _is_int(s) or not 0 <= s < SEED_SPAN):
            raise ValueError(f"seed[{i}] must be an int in [0, 2**64), got {s!r}")
    return tuple(seed)


def prompt_tokens(prompt_ids: Any, vocab_size: int, name: str = "prompt_ids") -> list[int]:
    """The prompt as a non-empty list of token ids in [0, vocab_size); a clear error for anything else."""
    if isinstance(prompt_ids, Mapping):
        prompt_ids = _from_encoding(prompt_ids, name)
    if isinstance(prompt_ids, torch.Tensor):
        prompt = _from_tensor(prompt_ids, name)
    elif isinstance(prompt_ids, (list, tuple)):
        prompt = _from_sequence(prompt_ids, name)
    else:
        raise TypeError(f"{name} must be a list of ints, a 1-D or [1, T] integer tensor, or a tokenizer's "
                        f"output holding 'input_ids'; got {type(prompt_ids).__name__}")
    if not prompt:
        raise ValueError(f"{name} is empty; give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return prompt


def prompt_batch(prompt_ids: Any, vocab_size: int, name: str = "prompt_ids") -> list[list[int]] | None:
    """The prompts of a batch as lists of ints, or None when `prompt_ids` is one prompt (for `prompt_tokens`).

    A list/tuple holding a list, tuple or tensor is a batch, so `[[1, 2, 3]]` is a batch of one; a flat
    list of ints, a tensor or a tokenizer's output is one prompt.
    """
    if not isinstance(prompt_ids, (list, tuple)):
        return None
    if not prompt_ids:
        raise ValueError(f"{name} is empty: give one prompt (a list of ints) or a batch (a list of prompts)")
    if not any(isinstance(p, (list, tuple, torch.Tensor)) for p in prompt_ids):
        return None
    ints = [i for i, p in enumerate(prompt_ids) if _is_int(p)]
    if ints:
        raise TypeError(f"{name} mixes token ids and prompts ({name}[{ints[0]}] is the int {prompt_ids[ints[0]]!r}): "
                        "give one prompt as a list of ints, or a batch as a list of prompts")
    return [_batch_row(p, vocab_size, f"{name}[{i}]") for i, p in enumerate(prompt_ids)]


def _batch_row(row: Any, vocab_size: int, name: str) -> list[int]:
    if isinstance(row, (list, tuple)):
        odd = next((t for t in row if not _is_int(t)), None)
        if odd is not None:
            raise TypeError(f"{name} must be a list of ints (one prompt of the batch), found "
                            f"{type(odd).__name__} {odd!r}")
    elif not isinstance(row, torch.Tensor):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor (one prompt of the batch), "
                        f"got {type(row).__name__}")
    return prompt_tokens(list(row) if isinstance(row, tuple) else row, vocab_size, name)


def token_ids(value: Any, name: str) -> tuple[int, ...]:
    """An int or a list/tuple of ints (never bools or strings), all >= 0, as a tuple; `name` goes in the error."""
    if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.dtype == torch.bool):
        value = value.flatten().tolist()  # transformers keeps generation_config's eos ids as a tensor
    items = [value] if _is_int(value) else value
    if not isinstance(items, (list, tuple)) or not all(_is_int(t) for t in items):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")
    negative = [t for t in items if t < 0]
    if negative:
        raise ValueError(f"{name} must hold token ids >= 0, got {value!r}")
    return tuple(items)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _from_encoding(encoding: Mapping, name: str) -> Any:
    if "input_ids" not in encoding:
        raise TypeError(f"{name} is a mapping without 'input_ids' (keys: {sorted(map(str, encoding))})")
    mask = encoding.get("attention_mask")
    if mask is not None:
        values = mask.flatten().tolist() if isinstance(mask, torch.Tensor) else _flatten_one_row(mask, name)
        if any(v != 1 for v in values):
            raise ValueError(f"{name}['attention_mask'] is not all ones: generate takes one unpadded prompt")
    return encoding["input_ids"]


def _from_tensor(ids: torch.Tensor, name: str) -> list[int]:
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D or [1, T] tensor (one prompt, batch size 1), "
                         f"got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}")
    return ids.tolist()


def _from_sequence(ids: list | tuple, name: str) -> list[int]:
    if len(ids) == 1 and isinstance(ids[0], (list, tuple)):  # a batch of one, as some tokenizer calls return
        ids = ids[0]
    if not all(_is_int(t) for t in ids):
        odd = next(t for t in ids if not _is_int(t))
        raise TypeError(f"{name} must be a list of ints (one prompt), found {type(odd).__name__} {odd!r}")
    return list(ids)


def _flatten_one_row(values: Any, name: str) -> list:
    if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}['attention_mask'] must be a list or a tensor, got {type(values).__name__}")
    return list(values)
