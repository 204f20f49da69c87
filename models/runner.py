"""`CachedRunner`: a `Llama` with its KV cache, speaking the decode loop's `StepModel` protocol.

A step reads everything that changes from one step to the next (token ids, output rows, L, the
relative positions, a tree's `tree_end`, the previous verdict's commit, sampling's seeds and positions) from
one device buffer, filled by one host-to-device copy; it returns the requested rows' logits and their
argmax (and, when asked, every row's top-k tokens and each row's sampled token), fetched by
one device-to-host copy. A program is keyed by the step's shape
only (W, N, the verification branch's size and form, the rows, the batch size): a tree that changes
every step is data, so on CUDA each shape is captured once as a CUDA graph and replayed.

With a batch dimension it also speaks the batched loop's `BatchStepModel` protocol (`prefill_batch`,
`step_batch`, `commit_batch`, `keep_rows`): b sequences in cache rows 0..b-1, each with its own L,
stepping together in one forward pass. The one-sequence protocol is the batch of one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import torch

from lookahead.kernels import StepPattern, device_binding
from lookahead.loop import StepOutput
from lookahead.loop.sampling import SampleRequest, sample_positions, seed_bits

from .attention import Attend, TorchBackend, TritonBackend, cached, prefill_attention
from .config import LlamaConfig
from .kv_cache import KVCache


class StepForward(Protocol):
    """What a runner needs of its model (a `Llama`): its config, backend, fusion, device and dtype, its forward and
    its step's forward (compiled under fusion "compile")."""

    config: LlamaConfig
    attn_backend: str
    fusion: str

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                 attention: Attend | None = None, rows: torch.Tensor | None = None) -> torch.Tensor: ...

    def step_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attend,
                     rows: torch.Tensor | None) -> torch.Tensor: ...


class StepShape(NamedTuple):
    """What one step program (one CUDA graph) is keyed by: the pattern's shape (a tree pattern stands for every
    tree of its size), the output rows R, the batch size, the top-k asked for, and whether it samples."""

    pattern: StepPattern
    rows: int
    batch: int = 1
    topk: int = 0
    sampling: bool = False


class CachedRunner:
    """Prefill, steps and commits over a preallocated cache of `batch` rows of `capacity` positions.

    `lengths` holds each live row's L, the positions holding committed entries. A commit is deferred:
    the copy of the accepted entries runs at the start of the next step (or prefill), inside its graph,
    one gather over every row, padded to `max_commit` entries per row so its shape never changes.

    cuda_graphs: capture each step shape (pattern, batch size) as a CUDA graph on its first use (or up front,
    `capture`) and replay it (CUDA and the Triton backend only; elsewhere steps run eagerly, the same code).
    Every launch, stream and capture is bound to the model's device (`device_binding`), so a model on cuda:N
    runs on GPU N whatever the current device.

    A step's `StepOutput.logits` are valid until the runner's next step (or `capture`): with CUDA graphs they are a
    view into the memory pool all of the runner's graphs share, which the next replay or capture (of any shape)
    overwrites. Callers that keep them longer copy them. (Cloning every step instead would add an R x vocab copy
    to every step for a need no caller has: the decode loops and the parallel driver read them within the step.)
    """

    def __init__(self, model: StepForward, capacity: int, max_step_tokens: int = 1, max_commit: int = 1,
                 cuda_graphs: bool = False, batch: int = 1) -> None:
        cfg = model.config
        if max_commit > max_step_tokens:
            raise ValueError(f"max_commit ({max_commit}) cannot exceed max_step_tokens ({max_step_tokens})")
        self.model = model
        self.device = model.device
        self.fusion = model.fusion  # the programs (and graphs) below are built with it
        self.cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim,
                             model.dtype, model.device)
        self.max_step_tokens, self.max_commit = max_step_tokens, max_commit
        if model.attn_backend == "triton":
            self.backend = TritonBackend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                         capacity, model.dtype, model.device)
        else:
            self.backend = TorchBackend(capacity, max_step_tokens, model.device)
        self.can_graph = self.device.type == "cuda" and self.backend.graphable
        self.cuda_graphs = cuda_graphs and self.can_graph  # may be switched between generations
        self._graph_pool = torch.cuda.graph_pool_handle() if self.can_graph else None
        self._programs: dict[tuple, _StepProgram] = {}  # (pattern shape, rows R, batch b, top-k, sampling)
        # the token ids of row 0's entries at positions 0, 1, ... (None: not known), for the next prompt to resume
        # from; they stay valid after a reset, which forgets the lengths, not the entries
        self.history: list[int] | None = None
        self.reused = 0  # positions the last prefill took from the cache instead of computing them
        self._step_tokens: list[int] = []
        self._commit: tuple[list[list[int]], list[list[int]]] | None = None
        self.reset()

    def reset(self, batch: int = 1) -> None:
        """Forget the sequences and start `batch` empty ones (the buffers and captured graphs stay, and a single
        sequence's entries are kept for the next prompt that begins with them: `prefill`)."""
        if not 1 <= batch <= self.cache.batch:
            raise ValueError(f"batch must be in 1..{self.cache.batch} (the cache's rows), got {batch}")
        if self.history is not None:
            self._apply_commit()  # the last verdict's entries: part of the history a next prompt may resume from
        self.lengths = [0] * batch
        self._commit = None
        if batch != 1:
            self.history = None  # another row may take row 0's place: its entries are no longer known

    @property
    def step_shapes(self) -> list[tuple]:
        """The step shapes prepared so far, one program (one CUDA graph on CUDA) each: (pattern shape, output rows,
        batch size, top-k, sampling)."""
        return list(self._programs)

    @property
    def length(self) -> int:
        """L of a single sequence."""
        (length,) = self.lengths
        return length

    def fits(self, capacity: int, max_step_tokens: int, max_commit: int, batch: int = 1) -> bool:
        """Whether this runner can serve a generation of that size on the model as it is now."""
        model = self.model
        return (self.cache.capacity >= capacity and self.max_step_tokens >= max_step_tokens
                and self.cache.batch >= batch
                and self.max_commit >= max_commit and self.cache.k.dtype == model.dtype
                and self.cache.k.device == model.device and self.backend.name == model.attn_backend
                and self.fusion == model.fusion)

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.prefill_batch([tokens])[0]

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0,
             sample: SampleRequest | None = None) -> StepOutput:
        return self.step_batch([tokens], pattern, [rows], topk, None if sample is None else [sample])[0]

    def commit(self, step_indices: Sequence[int]) -> None:
        self.commit_batch([step_indices])

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Each row's prompt after its L, one row at a time; the logits [b, V] of each prompt's last token.

        No padding is computed, and each row's prefill is exactly its prefill alone. One right-padded forward
        of all rows measured slower on ragged prompts (bench/batch.py: the `prefill` records of
        bench/results/batch-cpu.json)."""
        if len(prompts) != len(self.lengths):
            raise ValueError(f"{len(prompts)} prompts for {len(self.lengths)} sequences")
        self._check_room([len(p) for p in prompts])
        self._apply_commit()
        self.reused = self._resume(prompts)
        last = []
        for b, tokens in enumerate(prompts):
            start = self.lengths[b]
            tokens = tokens[self.reused:] if b == 0 else tokens  # the reused positions are in the cache
            ids = torch.tensor([list(tokens)], device=self.device)
            slots = torch.arange(start, start + len(tokens), device=self.device)
            attend = cached(self.cache, slots, prefill_attention(start), rows=slice(b, b + 1))
            last.append(self.model(ids, slots, attend, torch.tensor([len(tokens) - 1], device=self.device))[0, 0])
            self.lengths[b] += len(tokens)
        return torch.stack(last)

    def _resume(self, prompts: Sequence[Sequence[int]]) -> int:
        """A fresh sequence (L = 0) whose prompt begins with tokens whose entries the cache already holds (the last
        generation's prompt and output: a conversation's next turn) starts after them: positions reused, set as
        its L. History is kept for one sequence only; the prompt's last token always runs (its logits are needed).
        Returns the positions reused."""
        if len(prompts) != 1:
            self.history = None
            return 0
        prompt, start = list(prompts[0]), self.lengths[0]
        reuse = 0
        if start == 0 and self.history:
            limit = min(len(self.history), len(prompt) - 1)
            while reuse < limit and self.history[reuse] == prompt[reuse]:
                reuse += 1
        if start == 0 or self.history is not None:
            self.history = (self.history or [])[:start] + prompt
        self.lengths[0] = start + reuse
        return reuse

    def step_batch(self, tokens: Sequence[Sequence[int]], pattern: StepPattern | Sequence[StepPattern],
                   rows: Sequence[Sequence[int]], topk: int = 0,
                   sample: Sequence[SampleRequest] | None = None) -> list[StepOutput]:
        """Row b's `tokens[b]` laid out as `pattern` (one for every row, or one per row of a single shape: trees
        differ from row to row) at positions L_b + relative position; the outputs of its step indices
        `rows[b]` (the same count in every row), with topk > 0 also every step index's top-k tokens, and
        with `sample` (one request per row, one sampling setting) each row's sampled token."""
        patterns = [pattern] * len(tokens) if isinstance(pattern, StepPattern) else list(pattern)
        shape = patterns[0].shape
        if any(p.shape != shape for p in patterns):
            shapes = sorted({p.shape for p in patterns})
            raise ValueError(f"a batch step needs one step shape for every row, got {shapes}")
        self._check_room(patterns[0].num_tokens)
        key = (shape, len(rows[0]), len(tokens), topk, sample is not None)
        if key not in self._programs:
            self._programs[key] = _StepProgram(self, patterns[0], len(rows[0]), len(tokens), topk, sample is not None)
        program = self._programs[key]
        src, dst = self._commit if self._commit is not None else self._no_commit()
        self._commit = None
        self._step_tokens = list(tokens[0]) if len(tokens) == 1 else []  # what a commit of row 0 keeps
        return program.run(self, tokens, patterns, rows, self.lengths, src, dst, sample)

    def capture(self, shapes: Iterable[StepShape]) -> None:
        """Prepare the program of each step shape now (on CUDA with `cuda_graphs`: compile its kernels and capture
        its graph), so that no generation pays for it mid-way: batch sizes as rows finish, lookahead-parallel
        sub-step sizes, the self-tuned step sizes. Applies the pending commit first; changes no sequence (the
        capture writes only past each row's L, which the next step overwrites). Shapes already prepared are
        skipped."""
        shapes = list(shapes)
        for shape in shapes:
            if not isinstance(shape, StepShape):
                raise TypeError(f"shapes must hold StepShape values, got {type(shape).__name__}")
            if not 1 <= shape.batch <= self.cache.batch:
                raise ValueError(f"a StepShape's batch must be in 1..{self.cache.batch} (the cache's rows), "
                                 f"got {shape.batch}")
            if shape.pattern.num_tokens > self.max_step_tokens:
                raise ValueError(f"a StepShape of {shape.pattern.num_tokens} tokens exceeds this runner's "
                                 f"max_step_tokens ({self.max_step_tokens})")
        self._apply_commit()
        self.history = None  # a capture writes placeholder entries from each row's L on (0 after a reset)
        for shape in shapes:
            key = (shape.pattern.shape, shape.rows, shape.batch, shape.topk, shape.sampling)
            if key in self._programs and (self._programs[key].graph is not None or not self.cuda_graphs):
                continue
            lengths = (self.lengths + [0] * shape.batch)[: shape.batch]
            self._check_room_at(lengths, shape.pattern.num_tokens)
            program = self._programs.setdefault(key, _StepProgram(self, *shape))
            program.prepare(self, lengths)

    def commit_batch(self, step_indices: Sequence[Sequence[int]]) -> None:
        """Keep row b's entries `step_indices[b]` (a different count in each row) at L_b, L_b + 1, ..."""
        if self.history is not None and len(step_indices) == 1:
            self.history += [self._step_tokens[int(i)] for i in step_indices[0]]
        else:
            self.history = None
        src, dst = [], []
        for b, indices in enumerate(step_indices):
            count = len(indices)
            if not 0 < count <= self.max_commit:
                raise ValueError(f"a commit keeps 1..{self.max_commit} entries, got {count} in row {b}")
            start = self.lengths[b]
            end = self.lengths[b] = start + count
            pad = range(count, self.max_commit)  # self-copies past the new L: harmless, the next step overwrites them
            src.append([start + int(i) for i in indices] + [end + j for j in pad])
            dst.append([start + j for j in range(count)] + [end + j for j in pad])
        self._commit = (src, dst)

    def step_entries(self, step_indices: Sequence[int]) -> torch.Tensor:
        """One sequence: the KV entries [2, layers, Hkv, n, D] the last step wrote at these step indices (call it
        before that step's commit: they sit at L + index). Lookahead parallelism sends them to the ranks that did
        not compute them."""
        positions = torch.tensor([self.length + int(i) for i in step_indices], device=self.device)
        return self.cache.entries(positions)

    def empty_entries(self, count: int) -> torch.Tensor:
        """A tensor to receive `count` KV entries into, shaped as `step_entries` returns them."""
        cache = self.cache.k
        return torch.empty(2, cache.shape[0], cache.shape[2], count, cache.shape[4], dtype=cache.dtype,
                           device=self.device)

    def append_entries(self, entries: torch.Tensor) -> None:
        """One sequence: keep KV entries [2, layers, Hkv, n, D] computed elsewhere at L, L+1, ... (after the pending
        commit) and grow L by n."""
        self._apply_commit()
        self.history = None  # entries whose tokens this runner was not told
        count = entries.shape[3]
        self._check_room(count)
        positions = torch.arange(self.length, self.length + count, device=self.device)
        self.cache.put_entries(positions, entries.to(device=self.device, dtype=self.cache.k.dtype))
        self.lengths[0] += count

    def keep_rows(self, order: Sequence[int]) -> None:
        """Go on with rows `order` only: row i becomes what row order[i] was (finished rows leave the batch,
        so later steps spend nothing on them). Moves only the rows whose place changes."""
        if not order or len(set(order)) != len(order) or not all(0 <= r < len(self.lengths) for r in order):
            raise ValueError(f"order must name distinct rows of 0..{len(self.lengths) - 1}, got {list(order)}")
        self._apply_commit()
        self.history = None
        moved = [r for i, r in enumerate(order) if i != r]
        self.cache.keep_rows(list(order), max((self.lengths[r] for r in moved), default=0))
        self.lengths = [self.lengths[r] for r in order]

    def _no_commit(self) -> tuple[list[list[int]], list[list[int]]]:
        positions = [[length + j for j in range(self.max_commit)] for length in self.lengths]
        return positions, positions

    def _apply_commit(self) -> None:
        if self._commit is not None:
            src, dst = (torch.tensor(x, device=self.device) for x in self._commit)
            self.cache.move(src, dst)
            self._commit = None

    def _check_room(self, tokens: int | list[int]) -> None:
        """Room for `tokens` more positions in every row (a list: per row)."""
        self._check_room_at(self.lengths, tokens)

    def _check_room_at(self, lengths: list[int], tokens: int | list[int]) -> None:
        counts = tokens if isinstance(tokens, list) else [tokens] * len(lengths)
        for length, count in zip(lengths, counts, strict=True):
            if length + max(count, self.max_commit) > self.cache.capacity:
                raise ValueError(f"{count} tokens at L={length} overflow the KV cache "
                                 f"({self.cache.capacity} positions)")


class _StepProgram:
    """One step shape (pattern shape, output rows R, batch b, top-k, sampling): its device input buffer, the
    forward that reads only that buffer, its graph. It keeps no reference to its runner (the runner is passed
    to each call), so a dropped runner is freed at once, with its cache and graphs, not at the next collection."""

    def __init__(self, runner: CachedRunner, pattern: StepPattern, num_rows: int, batch: int, topk: int,
                 sampling: bool = False) -> None:
        self.pattern, self.batch = pattern, batch  # a tree pattern stands for its shape only
        self.num_rows, self.topk = num_rows, min(topk, runner.model.config.vocab_size)
        self.sampling = sampling
        device = runner.device
        t, k, v = pattern.num_tokens, runner.max_commit, pattern.verify_len if pattern.is_tree else 0
        s = num_rows if sampling else 0
        # inputs, row-major: token ids [b, T] | output rows [b, R] | L [b] | relative positions [b, T]
        #                    | tree_end [b, V] (tree form) | commit sources [b, K] | commit destinations [b, K]
        #                    | sampling: each row's seed [b] and its rows' absolute positions [b, R]
        self._shapes = ((batch, t), (batch, num_rows), (batch,), (batch, t), (batch, v), (batch, k), (batch, k),
                        (batch if sampling else 0,), (batch, s))
        self._splits = tuple(math.prod(shape) for shape in self._shapes)
        size = sum(self._splits)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self.staging.numpy()  # writes through to the (pinned) staging buffer
        # sampling's inputs, read after the graph (its target's parameters are the request's, not the graph's)
        self.seeds, self.sample_positions = (
            x.view(shape) for x, shape in zip(self.inputs.split(self._splits)[-2:], self._shapes[-2:], strict=True))
        self.offsets = torch.arange(t, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, runner: CachedRunner, tokens, patterns: list[StepPattern], rows, prefix_lens: list[int], src, dst,
            sample: Sequence[SampleRequest] | None) -> list[StepOutput]:
        sampled = [] if sample is None else [[seed_bits(r.seed)] for r in sample] + [list(r.positions) for r in sample]
        with device_binding(runner.device):
            graphed = runner.cuda_graphs
            if graphed and self.graph is None:
                # capture with a no-op commit: apply this call's commit first, outside the graph, so the
                # warm-up runs (which compile kernels) change nothing real
                runner.cache.move(*(torch.tensor(x, device=runner.device) for x in (src, dst)))
                src = dst = [[length + j for j in range(runner.max_commit)] for length in prefix_lens]
                self._stage(tokens, patterns, rows, prefix_lens, src, dst, sampled)
                self._capture(runner, prefix_lens)
            self._stage(tokens, patterns, rows, prefix_lens, src, dst, sampled)
            if graphed:
                self.graph.replay()
                logits, fetched = self.outputs
            else:
                logits, fetched = self.forward(runner, prefix_lens)
        if sample is not None:
            # after the graph, from its inputs: the target's parameters are the request's, not baked into the graph
            with device_binding(runner.device):
                winners = sample_positions(logits, sample[0].params, self.seeds, self.sample_positions)
            fetched = torch.cat([fetched, winners], dim=1)
        fetched = fetched.cpu()  # the step's one device-to-host copy: argmax [b, R], top-k [b, T, k], sampled [b, R]
        argmax = fetched[:, : self.num_rows].tolist()
        end = self.num_rows + self.pattern.num_tokens * self.topk
        topk = fetched[:, self.num_rows : end].view(self.batch, -1, self.topk) if self.topk else [None] * self.batch
        sampled = [None] * self.batch if sample is None else fetched[:, end:].tolist()
        return [StepOutput(*row) for row in zip(logits, argmax, topk, sampled, strict=True)]

    def prepare(self, runner: CachedRunner, prefix_lens: list[int]) -> None:
        """Ahead of any real step: stage placeholder inputs of this shape (the pattern's own tree, no-op commits)
        at L = `prefix_lens` and, with graphs on, capture; eagerly, run it once (the kernels compile)."""
        t = self.pattern.num_tokens
        tokens = [[0] * t] * self.batch
        rows = [[min(i, t - 1) for i in range(self.num_rows)]] * self.batch
        noop = [[length + j for j in range(runner.max_commit)] for length in prefix_lens]
        sampled = [[0]] * self.batch + [[0] * self.num_rows] * self.batch if self.sampling else []
        with device_binding(runner.device):
            self._stage(tokens, [self.pattern] * self.batch, rows, prefix_lens, noop, noop, sampled)
            if runner.cuda_graphs:
                self._capture(runner, prefix_lens)
            elif runner.device.type == "cuda":  # the kernels compile; on a CPU there is nothing to prepare
                self.forward(runner, prefix_lens)

    def _stage(self, tokens, patterns: list[StepPattern], rows, prefix_lens: list[int], src, dst,
               sampled: list[list[int]]) -> None:
        """The step's one host-to-device copy (from pinned memory on CUDA)."""
        flat = [t for row in tokens for t in row]
        flat += [r for row in rows for r in row]
        flat += prefix_lens
        for pattern in patterns:
            flat += pattern.relative_positions.tolist()
        for pattern in patterns:
            flat += pattern.tree_end or ()
        flat += [p for row in src for p in row]
        flat += [p for row in dst for p in row]
        for row in sampled:  # each row's seed, then each row's positions
            flat += row
        self._host[:] = flat
        self.inputs.copy_(self.staging, non_blocking=True)

    def forward(self, runner: CachedRunner, prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from `self.inputs` alone (`prefix_lens` are read only by a non-graphable backend): the rows'
        logits [b, R, V], and the int64 [b, ...] tensor the host fetches (each row's argmax, then every step
        index's top-k if asked). This is the region a CUDA graph captures."""
        tokens, rows, lengths, positions, tree_end, src, dst, _, _ = (
            x.view(shape) for x, shape in zip(self.inputs.split(self._splits), self._shapes, strict=True))
        runner.cache.move(src, dst)
        slots = lengths[:, None] + self.offsets  # [b, T]: the step's KV entries go right after each row's prefix
        attend = runner.backend.begin_step(self.pattern, prefix_lens, lengths,
                                           tree_end if self.pattern.is_tree else None)
        try:
            # top-k of every row needs the lm_head on every row, not only on the rows read
            logits = runner.model.step_forward(tokens, lengths[:, None] + positions,
                                               cached(runner.cache, slots, attend, rows=slice(0, self.batch)),
                                               None if self.topk else rows)
        finally:
            runner.backend.end_step()
        if not self.topk:
            return logits, logits.argmax(-1)
        top = logits.topk(self.topk, dim=-1).indices.flatten(1)  # [b, T * k]
        logits = logits[torch.arange(self.batch, device=logits.device)[:, None], rows]  # [b, R, V]
        return logits, torch.cat([logits.argmax(-1), top], dim=1)

    def _capture(self, runner: CachedRunner, prefix_lens: list[int]) -> None:
        """Two warm-up runs on a side stream (they compile the kernels), then the capture. Called under the
        runner's device binding: the side stream, the capture's stream and the launches are on its device."""
        side = torch.cuda.Stream(device=runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(runner, prefix_lens)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a capture mid-generation (a new sub-step size under lookahead parallelism) must not fail
        # on what other threads do meanwhile, such as NCCL's watchdog polling its events
        with torch.cuda.graph(graph, pool=runner._graph_pool, capture_error_mode="thread_local"):
            self.outputs = self.forward(runner, prefix_lens)
        self.graph = graph
