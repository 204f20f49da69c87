"""`Scheduler`: what the engine's next step runs. It keeps the waiting requests and the live rows, admits waiting
requests first come, first served while there are free rows and the model has room for them, and plans every live
row's part of one packed step: prompt chunks within the step's prefill allowance (beside decoding rows, as many prompt
tokens as keep the step within about twice their own cost by the cost model at the lengths involved, as the steps bore
its figures out, so a long prompt never stalls the streams beside it; alone, the model's whole chunk), then the
decoding rows, each self-tuned lookahead row sized by the budget of its own kind (one per sampled or greedy, static or
not). After the step, `record` tells the budgets what it did. It runs nothing and sends nothing: the engine does.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

from lookahead.tuning import CostModel, Fixed, StepBudget

from .core import step_budget
from .jobs import Job
from .rows import RowModel, RowStep

# a step with a prompt chunk beside decoding rows costs at most this many times their step alone, by the cost model
# at the chunk's own cache length: vLLM and SGLang give a step a budget in tokens (2048 or more), and at 6k tokens of
# context a 512-token chunk cost seconds on a 2-core CPU, every stream beside it waiting 150 times its usual gap
CHUNK_COST = 2.0
DECODE_RATE = 0.3  # how far one step without a chunk moves `Scheduler.decode_seconds` towards its own time
SCALE_RANGE = (1 / 16, 16.0)  # `Scheduler.scales`' bounds (one odd step never makes them absurd)
MIN_CHUNK = 1  # prompt tokens a step carries at least for a prefilling row, however busy the step
UNCOSTED_CHUNK = 16  # with no cost model: prompt tokens beside decoding rows, or four per token they feed if more


class Scheduler:
    """The waiting requests and live rows of an engine over `model` (at most `max_rows` live; None: as many as the
    model admits), and the step budgets of the cost model `cost` (None: full-size steps)."""

    def __init__(self, model: RowModel, max_rows: int | None, cost: CostModel | None) -> None:
        self.model, self.max_rows, self.cost = model, max_rows, cost
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        # one budget per (sampled, static): a row is sized by the curve of its own kind, never by another request's
        # configuration (None: that kind has no curve, so full steps)
        self.budgets: dict[tuple[bool, bool], StepBudget | None] = {}
        self._sized: list[tuple[StepBudget, dict[Job, float]]] = []  # the step's budgets, their rows' expected nodes
        self._lengths: list[int] = []
        # what the latest steps without a prompt chunk took (model time, a moving average; None: none yet): a chunk's
        # allowance is priced against it as well as against the cost model's figure for the decoding rows, which
        # counts a lookahead row at its smallest step
        self.decode_seconds: float | None = None
        # what steps took over what the cost model said they would, at their own tokens and lengths (moving averages
        # in log space, rate DECODE_RATE): steps with a prompt chunk beside decoding rows ("chunk"), and the others
        # ("decode"). A chunk's allowance weighs the model's figures by them: its per-position cost is fit on short
        # caches and under-prices a step with a chunk deep in a long prompt, whose attention reads the cache from
        # memory (docs/results.md, "A long prompt beside a stream")
        self.scales = {"chunk": 1.0, "decode": 1.0}

    def admit(self, fail: Callable[[list[Job], str], None]) -> None:
        """Admit waiting requests, first come first served, while there are free rows and the model has room; `fail`
        ends a request that can never fit. Raises RuntimeError when the head of the queue finds no room with no row
        live (nothing would ever free it)."""
        while self.waiting and (self.max_rows is None or len(self.active) < self.max_rows):
            job = self.waiting[0]
            try:
                place = self.model.admit(job.prompt, job.positions)
            except ValueError as e:  # can never fit: refuse it, admit the next
                self.waiting.popleft()
                fail([job], str(e))
                continue
            if place is None and not self.active:  # nothing will ever free room for it: fail it, not spin forever
                self.waiting.popleft()
                message = (f"the model has no room for a request of {len(job.prompt)} prompt tokens (up to "
                           f"{job.positions} positions) even with no other request running; shorten the prompt, ask "
                           "for fewer tokens, or give the model more memory")
                fail([job], message)
                raise RuntimeError(message)
            if place is None:
                return
            self.waiting.popleft()
            job.admitted(*place)
            self.active.append(job)

    def plan(self) -> tuple[list[Job], list[RowStep]]:
        """Every live row's part of the next step: prompt chunks within the step's prefill allowance, then the
        decoding rows: plain ones, full-size lookahead ones (`budget="fixed"`, or no cost model), then the self-tuned
        ones, each kind sized together by its budget around the rest."""
        decoding = [job for job in self.active if not job.prefilling]
        plain = [job for job in decoding if job.loop is None]
        lookahead = [job for job in decoding if job.loop is not None]
        allowance = None
        if len(decoding) < len(self.active):  # a row prefills: its chunk's allowance (costed: not worth it otherwise)
            fed = {job: 1 if job.loop is None else 1 + len(job.loop.window.levels) for job in decoding}
            first = next(job for job in self.active if job.prefilling)
            allowance = self._prefill_allowance(sum(fed.values()),
                                                sum(n * self._length_of(job) for job, n in fed.items()), first.filled)
        jobs, steps = [], []
        for job in self.active:
            if not job.prefilling or (allowance is not None and allowance <= 0 and (steps or decoding)):
                continue
            steps.append(job.chunk(allowance))
            jobs.append(job)
            allowance = None if allowance is None else allowance - len(steps[-1].tokens)
        chunks = len(steps)  # the step's prompt chunks come first
        groups: dict[StepBudget, list[Job]] = {}
        full = []
        for job in lookahead:
            job.draft_now()
            budget = self._budget_for(job)
            if budget is None:
                full.append(job)
            else:
                groups.setdefault(budget, []).append(job)
        for job in [*plain, *full]:
            jobs.append(job)
            steps.append(job.plan(None))
        expected = float(len(plain) + len(full))
        self._sized = []
        for budget, rows in groups.items():
            # the rest of the step, and that rest without its prompt chunks (they give no token now)
            fixed = self._fixed(jobs, steps, expected)
            steady = self._fixed(jobs[chunks:], steps[chunks:], expected) if chunks else None
            choices = budget.choose([job.draft.scores for job in rows], [job.loop.branch_tokens for job in rows],
                                    [job.loop.length for job in rows], fixed, steady)
            self._sized.append((budget, {job: sum(job.draft.scores[: min(choice.nodes, len(job.draft))])
                                         for job, choice in zip(rows, choices, strict=True) if choice.nodes}))
            for job, choice in zip(rows, choices, strict=True):
                jobs.append(job)
                steps.append(job.plan(choice))
                expected += choice.expected
        self._lengths = [self._length_of(job) for job in jobs]
        return jobs, steps

    def _fixed(self, jobs: Sequence[Job], steps: Sequence[RowStep], expected: float) -> Fixed:
        """The part of a step that `steps` of `jobs` make, giving `expected` tokens: what a budget sizes around."""
        return Fixed(sum(len(s.tokens) for s in steps), expected,
                     sum(len(s.tokens) * self._length_of(job) for job, s in zip(jobs, steps, strict=True)))

    @staticmethod
    def _length_of(job: Job) -> int:
        """The row's cache length L before the step."""
        return job.filled if job.prefilling else len(job.prompt) + len(job.out.result.tokens) - 1

    def _budget_for(self, job: Job) -> StepBudget | None:
        """The budget that sizes a lookahead row's steps (None: full-size steps): the one of its kind (sampled or
        greedy, static or not), made when the first row of that kind comes."""
        if self.cost is None or not job.loop.tunable:
            return None
        key = (job.seed is not None, job.loop.static)
        if key not in self.budgets:
            self.budgets[key] = step_budget(job.loop, self.cost, job.seed is not None, self.model)
        return self.budgets[key]

    def _prefill_allowance(self, decoding_tokens: int, decoding_weight: int, filled: int) -> int | None:
        """Prompt tokens the next step may carry (None: no limit) beside rows that feed `decoding_tokens` tokens over
        `decoding_weight` token-positions (tokens times cache length), the first prefilling row having `filled`
        positions cached: alone, the model's chunk; beside decoding rows, the most that the cost model says add to
        their step at most `CHUNK_COST` - 1 times its cost (the larger of the model's figure and what such steps
        took lately, `decode_seconds`), the model's figures weighed by what steps of each kind took over them lately
        (`scales`) (`MIN_CHUNK` at least, never past the chunk); with no cost model, `UNCOSTED_CHUNK` or four per
        decoding token."""
        chunk = self.model.prefill_chunk
        if decoding_tokens == 0 or chunk is None:
            return chunk
        if self.cost is None or not self.cost.curves:
            return min(chunk, max(UNCOSTED_CHUNK, 4 * decoding_tokens))
        kind = next(iter(self.cost.curves))

        def cost(size: int) -> float:
            tokens = decoding_tokens + size
            return self.cost.predict(tokens, (decoding_weight + size * filled) // tokens, kind)

        alone = cost(0) * self.scales["decode"]  # the model's figures, as the steps of each kind bore them out
        room = (CHUNK_COST - 1) * max(alone, self.decode_seconds or 0.0)  # what the chunk may add to the step
        low, high = 0, chunk  # the largest size within it: a step of more tokens never costs less
        while low < high:
            middle = (low + high + 1) // 2
            # (a step with a chunk holds the decoding rows too: weighed at least as theirs are)
            fits = cost(middle) * max(self.scales["chunk"], self.scales["decode"]) - alone <= room
            low, high = (middle, high) if fits else (low, middle - 1)
        return max(low, MIN_CHUNK)

    def record(self, steps: Sequence[RowStep], seconds: float, accepted: dict[Job, int],
               loop_seconds: float = 0.0) -> None:
        """What the planned step did, for the budgets that sized it: the model's time, `seconds`, the engine's own
        for the step, `loop_seconds` (from planning it to sending its tokens), and each sized row's accepted nodes."""
        tokens = sum(len(s.tokens) for s in steps)
        weight = sum(len(s.tokens) * length for s, length in zip(steps, self._lengths, strict=True))
        chunks = sum(s.prefill for s in steps)
        if steps and not chunks:
            last = self.decode_seconds
            self.decode_seconds = seconds if last is None else last + DECODE_RATE * (seconds - last)
        if chunks < len(steps) and self.cost is not None and self.cost.curves:  # decoding rows, maybe beside chunks
            kind = "chunk" if chunks else "decode"
            shown = seconds / self.cost.predict(tokens, weight // tokens, next(iter(self.cost.curves)))
            scale = math.exp(math.log(self.scales[kind])
                             + DECODE_RATE * (math.log(max(shown, SCALE_RANGE[0])) - math.log(self.scales[kind])))
            self.scales[kind] = min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1])
        for i, (budget, expected) in enumerate(self._sized):  # the cost model learns the step's time once
            budget.record_cost(tokens, weight // max(tokens, 1), seconds, loop_seconds, observe=i == 0)
            budget.record_drafts(list(expected.values()), [accepted[job] for job in expected])
