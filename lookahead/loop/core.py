"""The decode loop's shared parts, used by every driver (one prompt, a batch, lookahead parallelism, the transformers
adapter): the model protocol, what a step returns, the result, the output collector and the lookahead state.

It knows nothing of tokenizers or of the model's internals, so tests drive it with a mock model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lookahead.config import LookaheadConfig
from lookahead.drafts import BestFirst, ChainDrafts, DraftBuilder, DraftMemory, NGramPool, Sources
from lookahead.kernels import StepPattern
from lookahead.request import Request, SamplingParams
from lookahead.tuning import Choice, CostModel, StepBudget, bucket_choices

from .layout import StepLayout, full_pattern, pack_step
from .sampling import SampleRequest, fresh_seed
from .verify import Verdict, verify
from .window import LookaheadWindow

PLAIN_STEP = StepPattern(1, 2, 0)  # one token that sees the whole cache
Stream = Callable[[list[int]], None]


def path_step(tokens: int) -> StepPattern:
    """A step of `tokens` tokens: the input token and a path of tokens - 1 draft nodes (plain: one token). What a
    cost model times to learn what steps of each size cost."""
    return PLAIN_STEP if tokens == 1 else StepPattern(1, 2, tree_end=(tokens - 1,) * (tokens - 1))


@dataclass
class StepOutput:
    """What a step returns: the logits of the requested rows (on the model's device; valid until the model's next
    step, which may reuse their memory: copy to keep) and their argmax; when asked for, the top-k next tokens of
    every step row (the model's predictions after each token, for recycling) and each row's sampled token."""

    logits: torch.Tensor  # [R, V]
    argmax: list[int]  # [R], fetched in the step's one device-to-host copy
    topk: torch.Tensor | None = None  # [T, k] int64 on the host, fetched in the same copy
    sampled: list[int] | None = None  # [R]: the `SampleRequest`'s winners, fetched in the same copy


class StepModel(Protocol):
    """What the decode loop needs of a model with a KV cache.

    prefill: run the prompt into the cache; return the logits [V] of its last token.
    step: run `tokens` laid out as `pattern` describes, at positions L + relative position, writing
        their KV entries after the cache prefix; return the outputs of step indices `rows`, with
        topk > 0 the top-k tokens of every step index's output, and with a `sample` request each row's sampled
        token (`SampleRequest.fetch(logits)` does it; a device model folds it into its step's one copy). The
        loop passes topk and sample only when it needs them. A tree pattern changes every step: its
        tree is data, not a new shape to compile.
    commit: keep the KV entries of these step indices (at positions L, L+1, ...) and grow L by their
        number. A model may defer the copy to its next step, so a commit costs no launch of its own.
    """

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor: ...

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0,
             sample: SampleRequest | None = None) -> StepOutput:
        ...

    def commit(self, step_indices: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (its raw logits, before temperature or top-k/top-p), and
    the `top` most likely tokens at that position with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    """New tokens, the model forward passes made (the prefill counts one, however many chunks it took), the tokens
    each pass gave, and the tokens each decoding pass fed per row (`step_sizes`: 1 for a plain step; the prefill is
    not in it). `cached_tokens`: prompt tokens whose KV entries were taken from the cache (a prefix held from earlier
    sequences) instead of being prefilled. `finish_reason`: "stop" (a stop token or stop string), "length" (the token
    limit), "cancelled". `logprobs`: each token's log-probability, when asked for."""

    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    step_tokens: list[list[int]] = field(default_factory=list)
    step_sizes: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def compression(self) -> float:
        """S = tokens / forward passes (1.0 for plain decoding)."""
        return len(self.tokens) / self.steps if self.steps else 0.0


class Output:
    """Collects accepted tokens, stopping exactly at the first stop token, at the first token after which the text
    ends with a stop string (`stops_at`), or after `max_new_tokens` tokens (the request's)."""

    def __init__(self, max_new_tokens: int, stop: Iterable[int], stream: Stream | None,
                 stops_at: Callable[[int], bool] | None = None) -> None:
        self.result = GenerationResult()
        self.max_new_tokens, self.stop, self.stream, self.stops_at = max_new_tokens, frozenset(stop), stream, stops_at
        self.done = False

    def accept(self, tokens: Sequence[int], fed: int | None = None) -> list[int]:
        """A forward pass's tokens; `fed`: the tokens it fed per row (None: the prefill). Returns those taken."""
        result = self.result
        result.steps += 1
        if fed is not None:
            result.step_sizes.append(fed)
        # up to max_new_tokens, then up to the first stop (checked token by token in order: `stops_at` keeps state)
        taken = list(tokens[: max(self.max_new_tokens - len(result.tokens), 0)])
        stop, stops_at = self.stop, self.stops_at
        for i, token in enumerate(taken):
            if token in stop or (stops_at is not None and stops_at(token)):
                del taken[i + 1 :]
                self.done = True
                result.finish_reason = "stop"
                break
        result.tokens.extend(taken)
        result.step_tokens.append(taken)
        if not self.done and len(result.tokens) >= self.max_new_tokens:
            self.done = True
            result.finish_reason = "length"
        if self.stream is not None and taken:
            self.stream(taken)
        return taken


def first_token(logits: torch.Tensor, sampling: SamplingParams, seed: int | None, position: int) -> int:
    """The first new token, from the prefill's logits [V]; it takes absolute position `position` (the prompt's
    length). seed None: greedy."""
    if seed is None:
        return int(logits.argmax())
    return SampleRequest(sampling, seed, (position,)).fetch(logits[None])[0]


def static_steps(cfg: LookaheadConfig | None) -> list[tuple[StepPattern, int, int]]:
    """Every static step shape a generation with `cfg` can run, as a model's program sees it, packed by the loop
    itself: (pattern, output rows, top-k asked for). What a warm-up prepares ahead: the full step, and with
    `budget="auto"` each bucket's (`lookahead.tuning.buckets`), plain included."""
    if cfg is None:
        return [(PLAIN_STEP, 1, 0)]
    loop = LookaheadLoop(cfg, [0], 0, SamplingParams(), None, static=True)
    choices = bucket_choices(cfg) if loop.tunable else [None]
    layouts = [loop.pack(loop.draft(), choice) for choice in choices]
    return [(layout.pattern, len(layout.rows), layout.topk) for layout in layouts]


def step_budget(loop: LookaheadLoop, cost: CostModel | None, sampling: bool, model=None) -> StepBudget | None:
    """The per-step size chooser of an engine's rows: with a cost model and a self-tuned configuration
    (`loop.tunable`), else None (full-size steps). A cost model without a curve of sampled steps sizes them by its
    greedy curve. A model that rounds its steps up to captured sizes says so by a `round_up(tokens)` method."""
    if cost is None or not loop.tunable:
        return None
    kind = "sampling" if sampling and "sampling" in cost.curves else "greedy"
    round_up = getattr(model, "round_up", None)
    if kind not in cost.curves:
        return None
    return StepBudget(loop.cfg, cost, kind, loop.static, round_up=round_up)


def sampling_seed(request: Request, row: int) -> int | None:
    """Row `row`'s sampling seed: the request's, or a fresh one where it gives none; None when greedy."""
    if request.sampling.greedy:
        return None
    seed = request.seeds[row]
    return fresh_seed() if seed is None else seed


class LookaheadLoop:
    """The state of lookahead decoding between steps for one sequence: the 2D window, the n-gram pool, the draft
    policy (the tree's sources, or the paper's chains as a trie), the sequence. A driver calls `draft` for the next
    step's draft, `pack` with the size it chose for the layout, runs it, and `finish` with the step's outputs for the
    verdict; the driver commits."""

    def __init__(self, cfg: LookaheadConfig, prompt: Sequence[int], first: int, sampling: SamplingParams,
                 seed: int | None, static: bool, memory: DraftMemory | None = None) -> None:
        """seed: the generation's sampling seed (None: greedy). static: every step padded to its shape's full size
        (the configuration's, or a bucket's). memory: the drafting memory the tree form drafts from and `remember`
        adds to, when `cfg.warm` (otherwise, and for chains, it is neither read nor written)."""
        self.cfg, self.sampling, self.seed, self.static = cfg, sampling, seed, static
        self.memory = memory if cfg.warm and cfg.form == "tree" else None
        self.full = full_pattern(cfg)
        self.pool = NGramPool(cfg.ngram, cfg.guesses)
        self.sequence = list(prompt) + [first]
        if cfg.pool_from_prompt:
            self.pool.add_sequence(self.sequence)
        self.pooled_upto = len(self.sequence)  # n-grams starting before this index are in the pool
        self.window = LookaheadWindow(cfg.window, cfg.ngram, first, prompt)
        if cfg.form == "tree":
            self.drafts = DraftBuilder(self.sequence, Sources(cfg.draft_pool, cfg.draft_suffix, cfg.draft_recycle),
                                       pool_limit=cfg.guesses, memory=self.memory)
        else:
            self.drafts = ChainDrafts(cfg.ngram, cfg.guesses)

    def remember(self) -> None:
        """At the generation's end: add what it learned (its text, recycling tables and pool) to the memory."""
        if self.memory is not None:
            self.memory.add(self.sequence, self.drafts.recycle, self.pool)

    @property
    def tunable(self) -> bool:
        """Whether steps are sized per step (`budget="auto"`): the tree form's drafts are scored; the paper's chains
        run full-size steps."""
        return self.cfg.budget == "auto" and self.cfg.form == "tree"

    @property
    def length(self) -> int:
        """L: the positions in the cache before the input token."""
        return len(self.sequence) - 1

    @property
    def branch_tokens(self) -> int:
        """Tokens of the lookahead branch in the next step (all N - 1 levels when padded)."""
        return self.cfg.window * (self.cfg.ngram - 1 if self.static else len(self.window.levels))

    def draft(self) -> BestFirst:
        """The next step's draft nodes under the input token (the last token of the sequence), best first: the tree
        form's scored growth up to the node budget, or the paper's chains (unscored)."""
        if isinstance(self.drafts, DraftBuilder):
            return self.drafts.grow(self.sequence, self.pool, self.cfg.tree_nodes)
        tree = self.drafts.build(self.sequence, self.pool, self.cfg.tree_nodes, len(self.window.levels))
        return BestFirst(tree.tokens, tree.parents, [])

    def pack(self, draft: BestFirst, choice: Choice | None = None) -> StepLayout:
        """The step's layout for `choice` (None: the full step): the window's levels, unless a plain step, and the
        draft's first `choice.nodes` nodes, padded to the choice's shape when static."""
        if choice is None:
            return pack_step(self.window.levels, draft.tree(), self.full, self.static, self.drafts.topk)
        if not choice.branch:
            tree = draft.tree(choice.nodes)
            return pack_step(self.window.levels, tree, PLAIN_STEP, False, self.drafts.topk, branch=False)
        shape = self.full if choice.slots == self.cfg.tree_nodes else full_pattern(self.cfg, choice.slots)
        return pack_step(self.window.levels, draft.tree(choice.nodes), shape, self.static, self.drafts.topk)

    def plan(self) -> StepLayout:
        """The next step's full-size layout (`budget="fixed"`)."""
        return self.pack(self.draft())

    def step_requests(self, layout: StepLayout) -> dict:
        """The optional arguments of the model's step for `layout`: `topk` (recycling), `sample` (sampling)."""
        requests: dict = {"topk": layout.topk} if layout.topk else {}
        if self.seed is not None:
            # the input token is at absolute position len(sequence) - 1; a row's next token one after its own
            first = len(self.sequence)
            requests["sample"] = SampleRequest(self.sampling, self.seed, tuple(first + d for d in layout.row_depths))
        return requests

    def finish(self, layout: StepLayout, output: StepOutput, verdict: Verdict | None = None) -> Verdict:
        """Verify the step's outputs (or take `verdict`, decided by the caller: under a grammar's masks), let the draft
        sources learn from them, and move the window (when the step ran its lookahead branch) and the pool on; the
        caller commits the verdict."""
        verdict = self._verify(layout, output) if verdict is None else verdict
        if layout.topk:
            self._learn(layout, output, verdict)
        self._advance(verdict.tokens, [output.argmax[r] for r in layout.last_level_rows] if layout.branch else None)
        return verdict

    def _learn(self, layout: StepLayout, output: StepOutput, verdict: Verdict) -> None:
        """Every real row's top-k refills the recycling tables, keyed by that row's own context."""
        if output.topk is None:
            raise TypeError(f"the step asked for the top-{layout.topk} tokens of every row (draft_recycle), but the "
                            "model's step returned StepOutput.topk None: a StepModel must honour `topk`")
        # the accepted path's rows come last: their context was the true one, so their predictions win
        rows = layout.real_indices + layout.commit_indices(verdict)
        sequence = self.sequence
        before = (sequence[-3] if len(sequence) > 2 else -1, sequence[-2] if len(sequence) > 1 else -1)
        self.drafts.recycle.update_step(rows, layout.parents, layout.tokens, before, output.topk)

    def _verify(self, layout: StepLayout, output: StepOutput) -> Verdict:
        """Greedy: each slot's argmax; sampling: each slot's seeded winner (`lookahead.loop.sampling`)."""
        chosen = output.argmax
        if self.seed is not None:
            if output.sampled is None:
                raise TypeError("the step asked for sampled tokens (a SampleRequest), but the model's step returned "
                                "StepOutput.sampled None: a StepModel must honour `sample`")
            chosen = output.sampled
        return verify(layout.tree, [chosen[r] for r in layout.slot_rows])

    def _advance(self, accepted: list[int], outputs: list[int] | None) -> None:
        """outputs: the last level's predictions, None when the step did not run the lookahead branch (the window
        waits)."""
        if outputs is not None and self.window.full:
            for gram in self.window.columns(outputs):
                self.pool.add(gram)
        self.sequence.extend(accepted)
        self.drafts.extend(accepted)
        if self.cfg.pool_from_output:
            self.pool.add_sequence(self.sequence, start=self.pooled_upto - self.cfg.ngram + 1)
        self.pooled_upto = len(self.sequence)
        if outputs is None:
            self.window.hold(accepted[-1])
        else:
            self.window.advance(outputs, accepted[-1])
