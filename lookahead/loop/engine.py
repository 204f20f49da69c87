"""`Engine`: the decode loop's one driver. It owns a `RowModel` and runs packed steps over the live rows; requests join
after their prefill and leave when they stop or are cancelled.

One iteration (`step`): take what was submitted and cancelled since the last one; let the scheduler
(`scheduler.py`) admit waiting requests and plan every live row's part of one packed step (a chunk of its prompt, a
plain step, or a lookahead step sized by the budget); run it; hand each row its
outputs, commit what each accepted, send each request its new tokens; retire the rows that are done.

- **Exact whatever the traffic.** A row's tokens depend on its own prompt, settings and seed only: each row keeps its
  own lookahead state, seed and sampling settings, the model keeps each row's cache, and sampling draws are keyed by
  (seed, position) (`sampling.py`). So every request gets what it gets alone, whatever arrives before, beside or after
  it, and whatever step sizes the budget chose.
- **Chunked prefill.** A prompt enters in chunks that share steps with the decoding rows: while other rows decode, a
  step carries at most as many prompt tokens as keep its cost within twice the decoding rows' own (by the cost model,
  at the cache lengths involved: a chunk deep into a long prompt costs more per token), so a long prompt delays the
  others by about one step's time per step; alone, a prompt prefills in chunks of the model's `prefill_chunk`.
- **Two ways to drive it.** `run(request)` decodes a `Request`'s prompts in the caller's thread, every row joining at
  step 0 (what `decode` and `decode_batch`, so `Llama.generate`, do). `start()` runs steps on a thread of its own;
  `submit(...)` from any thread or asyncio task queues a request and returns a `Handle` (its deltas as they come,
  `cancel()`, `result()`), which is how the server uses it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lookahead.config import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.request import Request, check_context
from lookahead.tuning import CostModel

from .core import GenerationResult, StepModel, Stream, sampling_seed
from .grammar import TokenGrammar
from .jobs import MAX_LOGPROBS, Delta, Handle, Job, Sink
from .rows import RowModel, RowStep, SingleRowModel
from .scheduler import Scheduler

IDLE_WAIT = 0.5  # seconds the engine's thread sleeps between looks at an empty queue (a submit wakes it at once)


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full: try again later."""


@dataclass(frozen=True)
class Capacity:
    """What an engine takes: live rows at most (None: as many as the model admits); waiting requests at most beyond
    them (`submit` raises `QueueFull` past it; None: no limit); a request's positions (refused past them: the model's);
    its token ids (a prompt holding one outside [0, vocab_size) is refused: one bad id would fail every row of its
    step); and the lookahead configuration its model was sized for (`engine_for`'s; what a server's requests decode
    with; None: plain decoding)."""

    max_rows: int | None = None
    max_queue: int | None = None
    max_positions: int | None = None
    vocab_size: int | None = None
    lookahead: LookaheadConfig | None = None

    def __post_init__(self) -> None:
        for name, value in (("max_rows", self.max_rows), ("max_queue", self.max_queue)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


class Engine:
    """Runs packed steps over a `RowModel`'s rows. See the module docstring.

    capacity: what it takes (`Capacity`: rows, queue, positions, token ids, the lookahead it was sized for). cost: the
    machine's cost model (sizes self-tuned lookahead steps and prefill chunks; None: full-size steps). memory: the
    drafting memory rows draft from (warm drafting); each request adds to it when it ends.
    """

    def __init__(self, model: RowModel, *, capacity: Capacity = Capacity(), cost: CostModel | None = None,
                 memory: DraftMemory | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.memory, self.clock = model, memory, clock
        self.max_queue, self.max_positions = capacity.max_queue, capacity.max_positions
        self.vocab_size, self.lookahead = capacity.vocab_size, capacity.lookahead
        self.scheduler = Scheduler(model, capacity.max_rows, cost)
        self._inbox: list[Job] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.on_step: Callable[[Sequence[RowStep], float], None] | None = None  # what each step ran (metrics)

    # ----- submitting (any thread) -----

    def submit(self, request: Request, *, stops_at: Callable[[int], bool] | None = None, logprobs: int | None = None,
               sink: Sink | None = None, grammar: TokenGrammar | None = None) -> Handle:
        """Queue a `Request` of one prompt (what `run` takes: its limit, sampling and seed as `Llama.generate`
        takes them, its stop tokens, its lookahead); thread-safe. stops_at: called with each new token, True where
        the text now ends with a stop string. logprobs: with 0..20, each token comes with its log-probability and that
        many top alternatives. sink: called on the engine's thread with each `Delta` (default: the handle queues them
        for iteration). grammar: constrains the output (`lookahead.loop.grammar`; a fresh state, used by this request
        alone: it is advanced over the tokens the request takes). Raises ValueError for a request this engine cannot
        serve, QueueFull when the queue is full."""
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a lookahead.request.Request, got {type(request).__name__}")
        if len(request.prompts) != 1:
            raise ValueError(f"submit takes a request of one prompt, got {len(request.prompts)}; submit each "
                             "(or give the batch to run)")
        lookahead = request.lookahead
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS} or None, got {logprobs!r}")
        self._check_positions(request)
        self._check_vocabulary(request)
        limit = getattr(self.model, "max_step_tokens", None)
        if lookahead is not None and limit is not None and lookahead.step_tokens > limit:
            raise ValueError(f"lookahead {lookahead.window}-{lookahead.ngram}-{lookahead.guesses} steps feed up to "
                             f"{lookahead.step_tokens} tokens; this engine's model takes steps of at most {limit}: "
                             "give a smaller configuration")
        handle = Handle(lambda: self.cancel(job))
        job = Job(request, sampling_seed(request, 0), sink or handle.put, stops_at, logprobs, grammar)
        with self._wake:
            if self._stopping:
                raise QueueFull("the engine is shutting down")
            if self.max_queue is not None and len(self.waiting) + len(self._inbox) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already")
            self._inbox.append(job)
            self._wake.notify()
        return handle

    def cancel(self, job: Job) -> None:
        """Cancel a submitted request (applied at the next step boundary)."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    @property
    def waiting(self) -> collections.deque[Job]:
        """Requests waiting for a row (the scheduler's queue)."""
        return self.scheduler.waiting

    @property
    def active(self) -> list[Job]:
        """Requests with a row (the scheduler's live rows)."""
        return self.scheduler.active

    @property
    def cost(self) -> CostModel | None:
        return self.scheduler.cost

    @cost.setter
    def cost(self, cost: CostModel | None) -> None:
        self.scheduler.cost = cost

    @property
    def max_rows(self) -> int | None:
        return self.scheduler.max_rows

    @property
    def queued(self) -> int:
        """Requests waiting for a row."""
        return len(self.waiting) + len(self._inbox)

    # ----- running -----

    def run(self, request: Request, stream: Stream | Callable[[int, list[int]], None] | None = None
            ) -> list[GenerationResult]:
        """Decode every prompt of `request` in the caller's thread, all rows joining at step 0; one result per prompt.
        stream: called with each step's accepted tokens (with the prompt's index first for a batch). What the rows'
        drafting learned is added to the memory when all have ended, so rows never see each other's."""
        jobs = []
        for i, prompt in enumerate(request.prompts):
            one = Request([prompt], request.max_new_tokens, request.sampling, request.lookahead, request.stop,
                          request.seeds[i], request.static_step)
            jobs.append(Job(one, sampling_seed(request, i), _stream_sink(stream, i, request.batch), remember=False))
        self.waiting.extend(jobs)
        try:
            while self.step():
                pass
        except BaseException:  # the stream raised (a Ctrl-C the caller turned into a stop, say): free the rows
            self._abandon()
            raise
        for job in jobs:
            job.remember_drafts()
        return [job.out.result for job in jobs]

    def step(self) -> bool:
        """One iteration: admit, one packed step over the live rows, retire. Returns whether work remains."""
        self._take_inbox()
        self._retire([job for job in self.active if job.cancelled])
        self.scheduler.admit(self._fail)
        if not self.active:
            return bool(self.waiting)
        planned = self.clock()
        jobs, steps = self.scheduler.plan()
        start = self.clock()
        outputs = self.model.step(steps)
        seconds = self.clock() - start
        accepted = {}
        setup = 0.0  # finishing prompt chunks: a prompt's last sets up its row's lookahead loop (a request's cost)
        for job, step, output in zip(jobs, steps, outputs, strict=True):
            began = self.clock() if step.prefill else None
            commit, taken = job.finish(step, output, self.memory)
            if began is not None:
                setup += self.clock() - began
            self.model.commit(job.row, commit)
            accepted[job] = len(commit) - 1
            self._send(job, taken)
        if self.on_step is not None:
            self.on_step(steps, seconds)
        # the loop's own time for this step, not the time since the last one: a server's idle wait, a step the
        # budgets did not size (prompts alone) or a request's setup is no cost of the steps they size
        self.scheduler.record(steps, seconds, accepted, self.clock() - planned - seconds - setup)
        self._retire([job for job in self.active if job.out.done])
        return bool(self.active or self.waiting)

    def start(self) -> None:
        """Run steps on a thread of the engine's own until `stop()`."""
        if self._thread is not None:
            raise RuntimeError("the engine is running already")
        self._thread = threading.Thread(target=self._serve, name="lookahead-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, cancel every waiting and live one (each finishes as "cancelled" at the next step
        boundary) and end the thread."""
        with self._wake:
            self._stopping = True
            for job in [*self._inbox, *self.waiting, *self.active]:
                job.cancelled = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            with self._wake:
                if self._stopping and not (self.active or self.waiting or self._inbox):
                    return
                if not (self.active or self.waiting or self._inbox):
                    self._wake.wait(IDLE_WAIT)
                    continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 -- the engine outlives a failed step: its rows fail, others go on
                self._fail(self.active, f"{type(e).__name__}: {e}")

    # ----- the parts of a step -----

    def _take_inbox(self) -> None:
        with self._wake:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        cancelled = [job for job in self.waiting if job.cancelled]
        for job in cancelled:
            self.waiting.remove(job)
        self._finish(cancelled)

    def _send(self, job: Job, taken: list[int]) -> None:
        """A step's tokens to the job's sink; a done job's wait for its final delta (`_finish`)."""
        logprobs = None
        if job.logprobs is not None:
            logprobs = job.out.result.logprobs[len(job.out.result.logprobs) - len(taken):] if taken else []
        if job.out.done:
            job.pending = Delta(taken, logprobs)
        elif taken:
            job.sink(Delta(taken, logprobs))

    def _retire(self, jobs: list[Job]) -> None:
        """Done or cancelled rows leave: their memory is freed, their drafting remembered, their requests finished."""
        for job in jobs:
            self.active.remove(job)
            self.model.release(job.row)
            if job.remember:
                job.remember_drafts()
        self._finish(jobs)

    def _finish(self, jobs: list[Job]) -> None:
        """Each job's last delta: its last tokens, the finish reason ("cancelled" unless it was done) and the result."""
        for job in jobs:
            result = job.out.result
            if not job.out.done:
                result.finish_reason = "cancelled"
            last = job.pending or Delta([], [] if job.logprobs is not None else None)
            job.sink(Delta(last.tokens, last.logprobs, result.finish_reason, result))

    def _fail(self, jobs: list[Job], error: str) -> None:
        for job in list(jobs):
            if job in self.active:
                self.active.remove(job)
                try:
                    self.model.release(job.row)
                except Exception:  # noqa: BLE001 -- the row's memory is the model's to recover; the job still ends
                    pass
            job.out.result.finish_reason = "error"
            job.sink(Delta([], None, "error", job.out.result, error))

    def _abandon(self) -> None:
        """After an error in `run`: every row leaves (its blocks back to the model; what its commits keyed stays
        cached, the commits' moves still pending in the model), and nothing waits."""
        for job in self.active:
            try:
                self.model.release(job.row)
            except Exception:  # noqa: BLE001 -- the original error is the one to raise
                pass
        self.active.clear()
        self.waiting.clear()

    def _check_positions(self, request: Request) -> None:
        (prompt,) = request.prompts
        if self.max_positions is not None:
            check_context(len(prompt), request.max_new_tokens, self.max_positions)


    def _check_vocabulary(self, request: Request) -> None:
        (prompt,) = request.prompts
        bad = [t for t in prompt if t >= self.vocab_size] if self.vocab_size is not None else []
        if bad:
            raise ValueError(f"the prompt holds token id(s) {bad[:5]} outside the model's vocabulary "
                             f"[0, {self.vocab_size}); give ids the model's tokenizer produced")


def _stream_sink(stream, index: int, batch: bool) -> Sink:
    """A `Sink` that hands each delta's tokens to `stream` (as stream(index, tokens) for a batch)."""
    if stream is None:
        return lambda delta: None
    if batch:
        return lambda delta: delta.tokens and stream(index, delta.tokens)
    return lambda delta: delta.tokens and stream(delta.tokens)


def decode(model: StepModel, request: Request, stream: Stream | None = None, *, cost: CostModel | None = None,
           memory: DraftMemory | None = None) -> GenerationResult:
    """Generate for the request's one prompt over a one-sequence `StepModel` (the transformers adapter, a mock): the
    engine over `SingleRowModel`. `request.lookahead` None means plain decoding.

    request.static_step: feed every lookahead step at a static shape (the configuration's full size, or a self-tuned
    bucket's), missing levels and nodes padded; otherwise each step has the exact size of what it holds. The tokens
    are the same either way. stream: called with each step's accepted tokens. cost: the machine's cost model, which
    sizes each step when the configuration's budget is "auto" (None: full-size steps); it learns from this
    generation's steps. memory: the drafting memory to draft from and add to (with `LookaheadConfig.warm`); it
    changes drafts only, never tokens.
    """
    (result,) = Engine(SingleRowModel(model), cost=cost, memory=memory).run(request, stream)
    return result


def decode_batch(model: RowModel, request: Request, stream: Callable[[int, list[int]], None] | None = None, *,
                 cost: CostModel | None = None, memory: DraftMemory | None = None) -> list[GenerationResult]:
    """Generate for every prompt of the request over a `RowModel`, every row joining at step 0: one result per prompt,
    each what that prompt gives alone. stream: called as stream(prompt index, tokens) for a batch request (as
    stream(tokens) for a one-prompt one). cost and memory as `decode`; the rows' drafting is added to the memory when
    all have ended."""
    return Engine(model, cost=cost, memory=memory).run(request, stream)
