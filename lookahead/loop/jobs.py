"""A request inside the engine (`Job`), what it hands its caller as it goes (`Delta`), and the caller's handle on it
(`Handle`).

A job is one prompt's row: it prefills its prompt in chunks, takes its first token from the last chunk's logits, then
decodes, plain or with lookahead, until it stops (a stop token, a stop string its `stops_at` recognises, its token
limit) or is cancelled. Every step it plans its part of the packed step (`plan`) and takes its outputs back
(`finish`); nothing in it depends on the other rows, so it decodes what it decodes alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lookahead.drafts import BestFirst, DraftMemory
from lookahead.request import Request

from .core import PLAIN_STEP, GenerationResult, LookaheadLoop, Output, StepOutput, TokenLogprob
from .grammar import GrammarChoices, TokenGrammar, constrain_draft, masked_choice
from .layout import StepLayout
from .rows import RowStep
from .sampling import SampleRequest
from .verify import Verdict, verify

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_LOGPROBS = 20  # top log-probabilities a token may come with (the OpenAI API's limit)


@dataclass(frozen=True)
class Delta:
    """What a job gave in one step: its new tokens (each step's accepted tokens, cut at the stop), their
    log-probabilities when asked for, and on the last one the finish reason ("stop": a stop token or string; "length":
    the token limit; "cancelled"; "error", with `error` saying what) and the whole result."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: str | None = None


Sink = Callable[[Delta], None]


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class Job:
    """One request's row. request: one prompt, checked (`Request`); its seed resolved by the engine (None: greedy).
    stops_at: called with each new token, True where the text now ends with a stop string (the token ends the
    output). logprobs: top log-probabilities per token to report (0: the chosen token's only; None: none).
    grammar: the request's grammar (`lookahead.loop.grammar`): every chosen token is masked by it, drafts it rejects
    are cut, its forced tokens drafted; None: unconstrained."""

    request: Request
    seed: int | None
    sink: Sink
    stops_at: Callable[[int], bool] | None = None
    logprobs: int | None = None
    grammar: TokenGrammar | None = None
    remember: bool = True  # add what its drafting learned to the memory when it ends (a batch defers that)
    row: int | None = None
    cached: int = 0  # prompt positions taken from cached entries
    filled: int = 0  # prompt positions in the row's cache
    out: Output = field(init=False)
    loop: LookaheadLoop | None = None
    last: int = -1  # the next step's input token
    layout: StepLayout | None = None  # the last lookahead step's
    draft: BestFirst | None = None  # the next lookahead step's draft, best first
    pending: Delta | None = None  # a done job's last tokens, sent with its finish
    cancelled: bool = False

    def __post_init__(self) -> None:
        (prompt,) = self.request.prompts
        self.prompt = prompt
        self.out = Output(self.request.max_new_tokens, self.request.stop, None, self.stops_at)

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)

    @property
    def positions(self) -> int:
        """The most positions the row can reach: the prompt, the new tokens, and its largest step past them."""
        cfg = self.request.lookahead
        return len(self.prompt) + self.request.max_new_tokens + (cfg.step_tokens if cfg else 1)

    def admitted(self, row: int, cached: int) -> None:
        self.row, self.cached, self.filled = row, cached, cached
        self.out.result.cached_tokens = cached

    def chunk(self, budget: int | None) -> RowStep:
        """The next chunk of the prompt, at most `budget` tokens (None: the rest); the last one asks for the first
        token (sampled at the prompt's length)."""
        end = len(self.prompt) if budget is None else min(len(self.prompt), self.filled + max(budget, 1))
        sample = None
        if end == len(self.prompt) and self.seed is not None:
            sample = SampleRequest(self.request.sampling, self.seed, (len(self.prompt),))
        return RowStep.chunk(self.row, self.prompt[self.filled : end], sample)

    def plan(self, choice) -> RowStep:
        """The next decoding step: plain, or the lookahead loop's packed for `choice` (None: the full step)."""
        if self.loop is None:
            position = len(self.prompt) + len(self.out.result.tokens)  # where the next token goes
            sample = None if self.seed is None else SampleRequest(self.request.sampling, self.seed, (position,))
            self.layout = None
            return RowStep(self.row, [self.last], PLAIN_STEP, [0], sample=sample)
        self.layout = layout = self.loop.pack(self.draft, choice)
        requests = self.loop.step_requests(layout)
        return RowStep(self.row, layout.tokens, layout.pattern, layout.rows, requests.get("topk", 0),
                       requests.get("sample"))

    def draft_now(self) -> None:
        """Draft the next step's tree (before the budget sizes the step)."""
        self.draft = self.loop.draft() if self.loop is not None else None
        if self.draft is not None and self.grammar is not None:
            self.draft = constrain_draft(self.draft, self.grammar, self.loop.cfg.tree_nodes)

    def finish(self, step: RowStep, output: StepOutput, memory: DraftMemory | None) -> tuple[list[int], list[int]]:
        """Take a step's output; returns (step indices to commit, the step's new tokens as taken by the output)."""
        if step.prefill:
            commit = list(range(len(step.tokens)))
            self.filled += len(step.tokens)
            if self.prefilling:
                return commit, []
            self.last = self._choose(output, len(self.prompt))
            taken = self.out.accept([self.last])
            if self.request.lookahead is not None and not self.out.done:
                self.loop = LookaheadLoop(self.request.lookahead, self.prompt, self.last, self.request.sampling,
                                          self.seed, self.request.static_step, memory)
            return commit, self._logprobs(output, [0], taken)
        if self.loop is None:
            self.last = self._choose(output, len(self.prompt) + len(self.out.result.tokens))
            return [0], self._logprobs(output, [0], self.out.accept([self.last], 1))
        layout = self.layout
        verdict = None
        if self.grammar is not None:  # the walk's choices under the grammar's mask (the loop's own are unmasked)
            first, depths, rows = len(self.loop.sequence), layout.row_depths, layout.slot_rows
            verdict = verify(layout.tree, GrammarChoices(self.grammar, output.logits, rows,
                                                         [first + depths[r] for r in rows], self.request.sampling,
                                                         self.seed))
        verdict = self.loop.finish(layout, output, verdict)
        self.last = verdict.tokens[-1]
        taken = self.out.accept(verdict.tokens, layout.pattern.num_tokens)
        rows = _chosen_rows(layout, verdict) if self.logprobs is not None else []  # (asked for by few requests)
        return layout.commit_indices(verdict), self._logprobs(output, rows, taken)

    def _choose(self, output: StepOutput, position: int) -> int:
        """The token after a one-token step's output row 0, taking absolute `position`: the model's (argmax, or the
        seeded race's winner), under the grammar's mask when there is one."""
        if self.grammar is not None:
            return masked_choice(self.grammar, output.logits[0], self.request.sampling, self.seed, position)
        return output.argmax[0] if self.seed is None else output.sampled[0]

    def _logprobs(self, output: StepOutput, rows: list[int], taken: list[int]) -> list[int]:
        """Record the log-probabilities of the taken tokens (the model's output at the row before each) if asked;
        returns `taken`."""
        if self.logprobs is not None and taken:
            self.out.result.logprobs.extend(token_logprobs(output.logits[rows[: len(taken)]], taken, self.logprobs))
        return taken

    def remember_drafts(self) -> None:
        if self.loop is not None:
            self.loop.remember()


def _chosen_rows(layout: StepLayout, verdict: Verdict) -> list[int]:
    """The output row whose logits chose each token of the verdict: the input token's, then each accepted node's."""
    slots = layout.slot_rows
    return [slots[0], *(slots[1 + node] for node in layout.tree.path(verdict.node))]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """[n, V] logits of the rows that chose `tokens` [n] -> each token's log-probability and the `top` best."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        best = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        best = [()] * len(tokens)
    return [TokenLogprob(t, p, b) for t, p, b in zip(tokens, chosen, best, strict=True)]


class Handle:
    """A submitted request: iterate for its `Delta`s as they come (the last has a finish reason), `cancel()` it, or
    wait for its `result()`. Thread-safe; the engine's thread produces, any thread consumes."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._cancel = cancel
        self._deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._done = threading.Event()
        self._final: Delta | None = None

    def put(self, delta: Delta) -> None:
        """The engine's side: hand over one step's delta."""
        if delta.finish_reason is not None:
            self._final = delta
            self._done.set()
        self._deltas.put(delta)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def tokens(self) -> Iterator[int]:
        """The new tokens one by one as they are decided."""
        for delta in self:
            yield from delta.tokens

    def cancel(self) -> None:
        """Stop the request at the next step boundary (its row leaves; it finishes as "cancelled")."""
        self._cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end; the result (raises RuntimeError if the request failed, TimeoutError on timeout)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._final.finish_reason == "error":
            raise RuntimeError(f"the request failed: {self._final.error}")
        return self._final.result

