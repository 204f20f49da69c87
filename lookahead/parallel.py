"""Lookahead parallelism (the paper's §3.4): one generation over K processes that each hold the whole model.

Every rank runs the same loop (`_LookaheadLoop`: window, pool, drafts, sampler, all from the same arguments
and seed) and plans the same whole step (`StepLayout`). `substep.split_step` divides it: each rank runs
its sub-step (its share of the lookahead columns and of the verification branches, plus the input token
and the level-0 tokens they read), with no communication inside the forward pass. One all-gather then
gives every rank the outputs verification reads (`exchange.MessagePlan`: argmax rows, top-k for recycling,
the probabilities sampling reads), every rank runs the same `finish` and reaches the same verdict, and the
accepted entries' KV reach every rank's cache:

- "broadcast" (the default): the rank that computed the accepted path sends its entries, one broadcast;
- "refeed" (the authors' DIST_WORKERS): the other ranks run the accepted tokens again at the start of
  their next sub-step, as a chain above the input token.

`bench/distributed.py` measures both (docs/DESIGN.md, "Lookahead parallelism"). Sampling stays exactly
distributed: all ranks draw with one seed in the same order (the host's uniforms, one race's keys a step);
the rank that owns a verified slot computes its race winner and the probabilities of the drafts offered
there, which travel in the same all-gather. A rank whose step raises
tells the others in its message, so they raise too; a rank that dies or hangs is left to the process
group's timeout (`init_process_group(timeout=...)`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from .config import LookaheadConfig
from .engine import GenerationResult, StepModel, StepOutput, _choose, _LookaheadLoop, _Output
from .exchange import MessagePlan, failed_ranks
from .layout import StepLayout, full_pattern
from .sampling import Sampler, SamplingParams, sample_rows, split_sampled
from .substep import StepSplit, SubStep, split_step

KV_SYNCS = ("broadcast", "refeed")
BUCKET = 8  # static sub-steps are padded to a multiple of this: a few shapes (CUDA graphs), little padding


class ParallelStepModel(StepModel, Protocol):
    """A `StepModel` that can hand over KV entries (the "broadcast" KV sync).

    step_entries: the KV entries the last step wrote at these step indices, one tensor (before its commit).
    empty_entries: a tensor to receive `count` entries into. append_entries: keep received entries at L, L+1, ...
    """

    def step_entries(self, step_indices: Sequence[int]) -> torch.Tensor: ...

    def empty_entries(self, count: int) -> torch.Tensor: ...

    def append_entries(self, entries: torch.Tensor) -> None: ...


def step_capacity(config: LookaheadConfig) -> tuple[int, int]:
    """(most tokens of a sub-step, most entries a commit keeps) on any rank: the whole step's, plus the re-fed
    tokens of the previous step ("refeed")."""
    full = full_pattern(config)
    return full.num_tokens + full.max_commit - 1, 2 * full.max_commit - 1


def scaled_lookahead(config: LookaheadConfig, ranks: int) -> LookaheadConfig:
    """The paper's strong scaling: K ranks hold K times the window and the verification budget of one."""
    return LookaheadConfig(config.window * ranks, config.ngram, config.guesses * ranks, config.pool_from_prompt,
                           config.pool_from_output, config.form, config.draft_pool, config.draft_suffix,
                           config.draft_recycle)


def decode_parallel(
    model: ParallelStepModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    group: dist.ProcessGroup,
    sampling: SamplingParams,
    lookahead: LookaheadConfig,
    eos_token_ids: Iterable[int] = (),
    stream: Callable[[list[int]], None] | None = None,
    seed: int | None = None,
    device: torch.device | str = "cpu",
    static_step: bool = False,
    kv_sync: str = "broadcast",
    fingerprint: str = "",
) -> GenerationResult:
    """`engine.decode` with each lookahead step divided among the ranks of `group`; every rank returns the same
    result, the one a single process gives (greedy: token for token in float32; sampling: with the same seed).

    Every rank must call it with the same arguments (checked: a hash of them and of `fingerprint`, which the
    caller makes from the model, is all-gathered first). static_step: pad each rank's sub-step to a multiple of
    8 tokens (a few shapes for the whole generation). kv_sync: "broadcast" or "refeed" (module docstring).
    """
    comm = _Comm(group, torch.device(device))
    eos = frozenset(eos_token_ids)
    arguments = (list(prompt), max_new_tokens, sampling, lookahead, sorted(eos), seed, static_step, kv_sync,
                 fingerprint)
    seed = comm.agree(repr(arguments), seed)  # first, so that the checks below fail on every rank or on none
    if kv_sync not in KV_SYNCS:
        raise ValueError(f"kv_sync must be one of {', '.join(KV_SYNCS)}, got {kv_sync!r}")
    if lookahead.window < comm.ranks:
        raise ValueError(f"lookahead parallelism over {comm.ranks} ranks needs a window of at least one column per "
                         f"rank, got W={lookahead.window}; use W >= {comm.ranks} (scaled_lookahead(config, K) scales "
                         "W and G with K)")
    sampler = None if sampling.greedy else Sampler(seed, torch.device(device))
    out = _Output(max_new_tokens, eos, stream)
    last = comm.first_token(lambda: _choose(model.prefill(prompt)[None], sampling, sampler))
    # an error of this rank's own between collectives (its `stream`) is raised inside the next step's work, so the
    # others learn of it there instead of waiting for this rank at that step's all-gather
    failure = _accept(out, [last])
    loop = _LookaheadLoop(lookahead, prompt, last, sampling, sampler, static=False)
    sync = _KVSync(model, comm, kv_sync)
    max_tokens = step_capacity(lookahead)[0]
    while not out.done:
        layout = loop.plan(last)
        split = split_step(layout, comm.ranks)
        sub = split.sub_step(layout, comm.rank, sync.pending, 0)
        if static_step:
            real = len(sub.tokens)
            sub = split.sub_step(layout, comm.rank, sync.pending, min(-(-real // BUCKET) * BUCKET, max_tokens))
        plan = MessagePlan.of(layout, split, sampler is not None)
        work = partial(_run_sub_step, model, layout, sub, plan, comm.rank, sampling, sampler, static_step)
        if failure is not None:
            work = partial(_reraise, failure)
        gathered = comm.run_step(work, plan)
        argmax, topk, sampled = plan.unpack(layout, gathered)
        full = StepOutput(torch.empty(0), [argmax[i] for i in layout.rows],
                          torch.tensor([topk[i] for i in range(len(layout.tokens))]) if layout.topk else None,
                          sampled)
        verdict = loop.finish(layout, full)
        sync.commit(layout, split, sub, layout.commit_indices(verdict.candidate, verdict.run))
        last = verdict.tokens[-1]
        failure = _accept(out, verdict.tokens)
    if failure is not None:
        raise failure
    return out.result


def _accept(out: _Output, tokens: list[int]) -> Exception | None:
    try:
        out.accept(tokens)
    except Exception as e:  # re-raised at the next collective (or at the end), see decode_parallel
        return e
    return None


def _reraise(failure: Exception):
    raise failure


def _run_sub_step(model: StepModel, layout: StepLayout, sub: SubStep, plan: MessagePlan, rank: int,
                  sampling: SamplingParams, sampler: Sampler | None, static: bool) -> torch.Tensor:
    """This rank's forward pass, and its message."""
    if static:
        rows = list(range(len(sub.tokens)))
    else:
        wanted = [i for i in sub.owned if i in layout.row_of] or [0]
        rows = [sub.local[i] for i in wanted]
    topk = {"topk": layout.topk} if layout.topk else {}
    output = model.step(list(sub.tokens), sub.pattern, rows, **topk)
    row = {local: r for r, local in enumerate(rows)}
    argmax = {i: output.argmax[row[sub.local[i]]] for i in plan.argmax[rank]}
    top = {i: output.topk[sub.local[i]] for i in plan.topk[rank]}
    draws: dict[int, int] = {}
    probs: dict[tuple[int, int], float] = {}
    if sampler is not None:
        # one race's keys a step on every rank, as a single process draws them: the generators stay in step, and
        # each slot's winner is the one a single process picks
        keys = sampler.keys(output.logits.shape[-1])
        verified = plan.draws[rank]
        if verified:
            slot = {layout.slot(i): n for n, i in enumerate(verified)}
            pairs = plan.probs[rank]
            pair_rows = torch.tensor([[slot[s] for s, _ in pairs], [t for _, t in pairs]], dtype=torch.int64)
            logits = output.logits[[row[sub.local[i]] for i in verified]]
            fetched = sample_rows(logits[None], sampling, pair_rows.view(1, 2, -1).to(logits.device), keys[None])
            slot_draws, pair_probs = split_sampled(fetched[0].cpu(), len(verified), len(pairs))
            draws = dict(zip(verified, slot_draws, strict=True))
            probs = dict(zip(pairs, pair_probs, strict=True))
    return plan.pack(rank, argmax, top, draws, probs)


class _KVSync:
    """Brings the accepted entries' KV to every rank after a verdict ("broadcast" or "refeed")."""

    def __init__(self, model: ParallelStepModel, comm: _Comm, mode: str) -> None:
        self.model, self.comm, self.mode = model, comm, mode
        self.pending: list[int] = []  # refeed: accepted tokens whose KV this rank has not computed yet

    def commit(self, layout: StepLayout, split: StepSplit, sub: SubStep, keep: list[int]) -> None:
        """keep: the step indices of the verdict (the input token, then the accepted path)."""
        prefix = list(range(sub.prefix))  # re-fed tokens: committed first, in order
        path = keep[1:]
        source = split.owner[path[-1]] if path else self.comm.rank
        if source == self.comm.rank:  # computed the whole path (its branch is its own)
            if path and self.mode == "broadcast":
                entries = self.model.step_entries([sub.local[i] for i in path])
                self.comm.broadcast(entries, source)
            self.model.commit(prefix + [sub.local[i] for i in keep])
            self.pending = []
            return
        self.model.commit(prefix + [sub.local[0]])
        if self.mode == "broadcast":
            self.model.append_entries(self.comm.broadcast(self.model.empty_entries(len(path)), source))
            self.pending = []
        else:
            self.pending = [layout.tokens[i] for i in path]


class _Comm:
    """The collectives of one generation on `group` (tensors on the model's device for NCCL, on the CPU for gloo)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def agree(self, arguments: str, seed: int | None) -> int:
        """Check that every rank got the same arguments; the seed everyone uses (rank 0's draw if None)."""
        digest = int.from_bytes(hashlib.blake2b(arguments.encode(), digest_size=7).digest(), "little")
        proposal = seed if seed is not None else random.SystemRandom().randrange(2**63)
        mine = torch.tensor([digest, proposal % 2**63, (proposal >> 63) & 1], dtype=torch.int64, device=self.device)
        every = self._all_gather(mine).tolist()
        differ = [rank for rank, (d, _, _) in enumerate(every) if d != every[0][0]]
        if differ:
            raise ValueError(f"lookahead parallelism: ranks {differ} were called with different arguments from rank 0 "
                             "(prompt, max_new_tokens, sampling, lookahead, eos, seed, static_step, kv_sync or the "
                             "model): every rank must generate with the same ones")
        return every[0][1] + (every[0][2] << 63)

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
