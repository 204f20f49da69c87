"""Lookahead parallelism (the paper's §3.4): one generation over K processes that each hold the whole model.

Every rank runs the same loop (`LookaheadLoop`: window, pool, drafts, sampler, all from the same request and
seed; no drafting memory, which is per process, so drafting is cold) and plans the same whole step (`StepLayout`).
`substep.split_step` divides it: each rank runs its sub-step
(its share of the lookahead columns and of the verification branches, plus the input token and the level-0
tokens they read), with no communication inside the forward pass. One all-gather then gives every rank the
outputs verification reads (`exchange.MessagePlan`: argmax rows, top-k for recycling, the probabilities sampling
reads), every rank runs the same `finish` and reaches the same verdict, and the rank that computed the accepted
path broadcasts its entries' KV to the others (the authors re-feed the accepted tokens instead; broadcasting
measured no slower, docs/DESIGN.md).

Sampling is keyed by position (`lookahead.loop.sampling`): the rank that owns an output row computes its seeded
winner, which travels in the same all-gather, and is what one process would draw there. A rank whose step raises
tells the others in its message, so they raise too; a rank that dies or hangs is left to the process group's timeout
(`init_process_group(timeout=...)`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from lookahead.config import LookaheadConfig
from lookahead.kernels import StepPattern
from lookahead.loop import GenerationResult, LookaheadLoop, Output, StepLayout, StepModel, StepOutput, first_token
from lookahead.loop.core import Stream
from lookahead.loop.sampling import SampleRequest
from lookahead.request import Request

from .exchange import MessagePlan, failed_ranks
from .substep import SubStep, split_step

BUCKET = 8  # static sub-steps are padded to a multiple of this: a few shapes (CUDA graphs), little padding


def padded_size(tokens: int, step_tokens: int) -> int:
    """A static sub-step of `tokens` real tokens, padded to the next multiple of BUCKET, at most the whole step's."""
    return min(-(-tokens // BUCKET) * BUCKET, step_tokens)


def sub_step_patterns(config: LookaheadConfig) -> list[StepPattern]:
    """The shape of every static sub-step a rank can run for `config` (a tree pattern of each padded size; a
    sub-step's tree is data): what a warm-up prepares ahead."""
    sizes = sorted({padded_size(n, config.step_tokens) for n in range(1, config.step_tokens + 1)})
    return [StepPattern(1, 2, tree_end=tuple(range(1, size))) for size in sizes]


class ParallelStepModel(StepModel, Protocol):
    """A `StepModel` that can hand over KV entries, on `device` (where NCCL's collectives run).

    step_entries: the KV entries the last step wrote at these step indices, one tensor (before its commit).
    empty_entries: a tensor to receive `count` entries into. append_entries: keep received entries at L, L+1, ...
    """

    device: torch.device

    def step_entries(self, step_indices: Sequence[int]) -> torch.Tensor: ...

    def empty_entries(self, count: int) -> torch.Tensor: ...

    def append_entries(self, entries: torch.Tensor) -> None: ...


def agree(group: dist.ProcessGroup, build: Callable[[], Request], fingerprint: str = "") -> Request:
    """The request every rank of `group` generates for, built on each rank by `build` (which checks the caller's
    arguments); the ranks compare before any of them acts on it. A rank whose arguments were refused, or whose
    request (or model `fingerprint`) differs from rank 0's, makes every rank raise the same `ValueError` within one
    collective, instead of the others waiting at the next one for the group's timeout. A None seed becomes rank 0's
    draw, so every rank samples alike."""
    try:
        request, error = build(), None
    except (ValueError, TypeError) as e:
        request, error = None, f"{type(e).__name__}: {e}"
    digest = "" if request is None else hashlib.blake2b(f"{request!r}|{fingerprint}".encode()).hexdigest()
    proposal = random.SystemRandom().randrange(2**63)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (error, digest, proposal), group=group)
    refused = [(rank, e) for rank, (e, _, _) in enumerate(every) if e is not None]
    if refused:
        rank, first = refused[0]
        raise ValueError(f"lookahead parallelism: rank(s) {[r for r, _ in refused]} refused their arguments (rank "
                         f"{rank}: {first}); every rank stops")
    differ = [rank for rank, (_, d, _) in enumerate(every) if d != every[0][1]]
    if differ:
        raise ValueError(f"lookahead parallelism: ranks {differ} were called with different arguments from rank 0 "
                         "(prompt, max_new_tokens, sampling, lookahead, eos, seed, static_step or the model): every "
                         "rank must generate with the same ones")
    if request.sampling.greedy or request.seeds[0] is not None:
        return request
    return Request(request.prompts, request.max_new_tokens, request.sampling, request.lookahead, request.stop,
                   (every[0][2],), request.static_step)


def decode_parallel(model: ParallelStepModel, request: Request, group: dist.ProcessGroup,
                    stream: Stream | None = None) -> GenerationResult:
    """`loop.decode` with each lookahead step divided among the ranks of `group`; every rank returns the same result,
    the one a single process gives (greedy: token for token in float32; sampling: with the same seed).

    Every rank must call it with the same request (`agree` checks and completes it first). request.static_step: pad
    each rank's sub-step to a multiple of 8 tokens (a few shapes for the whole generation). Steps are full-size
    whatever the configuration's budget: the ranks' shares of one step are what lookahead parallelism divides.
    """
    comm = _Comm(group, model.device)
    (prompt,) = request.prompts
    lookahead, sampling = request.lookahead, request.sampling
    seed = None if sampling.greedy else request.seeds[0]  # `agree` made it rank 0's where there was none
    out = Output(request.max_new_tokens, request.stop, stream)
    last = comm.first_token(lambda: first_token(model.prefill(prompt), sampling, seed, len(prompt)))
    # an error of this rank's own between collectives (its `stream`) is raised inside the next step's work, so the
    # others learn of it there instead of waiting for this rank at that step's all-gather
    failure = _accept(out, [last])
    loop = LookaheadLoop(lookahead, prompt, last, sampling, seed, static=False)
    max_tokens = lookahead.step_tokens
    while not out.done:
        layout = loop.plan()
        split = split_step(layout, comm.ranks)
        sub = split.sub_step(layout, comm.rank)
        if request.static_step:
            sub = split.sub_step(layout, comm.rank, padded_size(len(sub.tokens), max_tokens))
        plan = MessagePlan.of(layout, split, seed is not None)
        sample = loop.step_requests(layout).get("sample")
        work = partial(_run_sub_step, model, layout, sub, plan, comm.rank, sample, request.static_step)
        if failure is not None:
            work = partial(_reraise, failure)
        gathered = comm.run_step(work, plan)
        argmax, sampled, topk = plan.unpack(gathered)
        full = StepOutput(torch.empty(0), [argmax[i] for i in layout.rows],
                          torch.tensor([topk[i] for i in range(len(layout.tokens))]) if layout.topk else None,
                          [sampled.get(i, -1) for i in layout.rows] if seed is not None else None)
        verdict = loop.finish(layout, full)
        _commit(model, comm, split.owner, sub, layout.commit_indices(verdict))
        failure = _accept(out, verdict.tokens, len(layout.tokens))
    if failure is not None:
        raise failure
    return out.result


def _accept(out: Output, tokens: list[int], fed: int | None = None) -> Exception | None:
    try:
        out.accept(tokens, fed)
    except Exception as e:  # re-raised at the next collective (or at the end), see decode_parallel
        return e
    return None


def _reraise(failure: Exception):
    raise failure


def _run_sub_step(model: StepModel, layout: StepLayout, sub: SubStep, plan: MessagePlan, rank: int,
                  sample: SampleRequest | None, static: bool) -> torch.Tensor:
    """This rank's forward pass, and its message. sample: the whole step's request (positions by layout row)."""
    if static:
        rows = list(range(len(sub.tokens)))
    else:
        wanted = [i for i in sub.owned if i in layout.row_of] or [0]
        rows = [sub.local[i] for i in wanted]
    topk = {"topk": layout.topk} if layout.topk else {}
    output = model.step(list(sub.tokens), sub.pattern, rows, **topk)
    row = {local: r for r, local in enumerate(rows)}
    reported = plan.rows[rank]
    argmax = {i: output.argmax[row[sub.local[i]]] for i in reported}
    top = {i: output.topk[sub.local[i]] for i in plan.topk[rank]}
    sampled: dict[int, int] = {}
    if sample is not None and reported:
        # the winners of this rank's rows, at the positions the whole step's request gives them: keyed by position,
        # they are what one process would draw there
        mine = SampleRequest(sample.params, sample.seed, tuple(sample.positions[layout.row_of[i]] for i in reported))
        sampled = dict(zip(reported, mine.fetch(output.logits[[row[sub.local[i]] for i in reported]]), strict=True))
    return plan.pack(rank, argmax, sampled, top)


def _commit(model: ParallelStepModel, comm: _Comm, owner: Sequence[int], sub: SubStep, keep: list[int]) -> None:
    """Bring the verdict's entries (`keep`: the input token, then the accepted path) into every rank's cache: the
    path lies in one verification branch, so one rank computed all of it and broadcasts it; the input token was
    computed everywhere."""
    path = keep[1:]
    source = owner[path[-1]] if path else comm.rank
    if source == comm.rank:  # computed the whole path (its branch is its own)
        if path:
            comm.broadcast(model.step_entries([sub.local[i] for i in path]), source)
        model.commit([sub.local[i] for i in keep])
        return
    model.commit([sub.local[0]])
    model.append_entries(comm.broadcast(model.empty_entries(len(path)), source))


class _Comm:
    """The collectives of one generation on `group` (tensors on the model's device for NCCL, on the CPU for gloo)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def first_token(self, choose: Callable[[], int]) -> int:
        """Every rank prefills and chooses (so the samplers stay in step); rank 0's token is everyone's."""
        status, token = 1, 0
        try:
            token = choose()
        except Exception:
            self._all_gather(torch.tensor([-1, 0], dtype=torch.int64, device=self.device))
            raise
        every = self._all_gather(torch.tensor([status, token], dtype=torch.int64, device=self.device)).tolist()
        _raise_failed([rank for rank, (s, _) in enumerate(every) if s != 1])
        return every[0][1]

    def run_step(self, work: Callable[[], torch.Tensor], plan: MessagePlan) -> torch.Tensor:
        """Run this rank's sub-step (`work` returns its message) and all-gather the messages [K, size]; a failure
        anywhere raises on every rank."""
        try:
            message = work()
        except Exception:
            self._all_gather(plan.failed().to(self.device))
            raise
        gathered = self._all_gather(message.to(self.device)).cpu()
        _raise_failed(failed_ranks(gathered))
        return gathered

    def broadcast(self, tensor: torch.Tensor, source: int) -> torch.Tensor:
        """`tensor` from rank `source` (a group rank) on every rank; returns it on the caller's device."""
        home = tensor.device
        moved = tensor.to(self.device).contiguous()
        dist.broadcast(moved, dist.get_global_rank(self.group, source), group=self.group)
        return moved.to(home)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.ranks)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)


def _raise_failed(ranks: list[int]) -> None:
    if ranks:
        raise RuntimeError(f"lookahead parallelism: rank(s) {ranks} failed in this step (see their error); "
                           "every rank stops")
