"""`CachedRunner`: a `Llama` with its KV cache, speaking the decode loop's `StepModel` protocol.

A step reads everything that changes from one step to the next (token ids, output rows, L, the
relative positions, a tree's `tree_end`, the previous verdict's commit) from one device buffer, filled
by one host-to-device copy; it returns the requested rows' logits and their argmax (and, when asked,
every row's top-k tokens), fetched by one device-to-host copy. A program is keyed by the step's shape
only (W, N, the verification branch's size and form, the rows): a tree that changes every step is data,
so on CUDA each shape is captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lookahead.engine import StepOutput
from lookahead.kernels import StepPattern

from .attention import TorchBackend, TritonBackend, cached, prefill_attention
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .llama import Llama


class CachedRunner:
    """Prefill, steps and commits over a preallocated cache of `capacity` positions.

    `length` is L, the positions holding committed entries. A commit is deferred: the copy of the
    accepted entries runs at the start of the next step (or prefill), inside its graph, padded to
    `max_commit` entries so its shape never changes.

    cuda_graphs: capture each step pattern as a CUDA graph on its first use and replay it (CUDA and
    the Triton backend only; elsewhere steps run eagerly, the same code).
    """

    def __init__(self, model: Llama, capacity: int, max_step_tokens: int = 1, max_commit: int = 1,
                 cuda_graphs: bool = False) -> None:
        cfg = model.config
        if max_commit > max_step_tokens:
            raise ValueError(f"max_commit ({max_commit}) cannot exceed max_step_tokens ({max_step_tokens})")
        self.model = model
        self.device = model.device
        self.cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, capacity, cfg.head_dim,
                             model.dtype, model.device)
        self.max_step_tokens, self.max_commit = max_step_tokens, max_commit
        if model.attn_backend == "triton":
            self.backend = TritonBackend(1, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                         capacity, model.dtype, model.device)
        else:
            self.backend = TorchBackend(capacity, max_step_tokens, model.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.backend.graphable
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._programs: dict[tuple, _StepProgram] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the sequence (the buffers and captured graphs stay for the next one)."""
        self.length = 0
        self._commit: tuple[list[int], list[int]] | None = None

    def fits(self, capacity: int, max_step_tokens: int, max_commit: int, cuda_graphs: bool) -> bool:
        """Whether this runner can serve a generation of that size on the model as it is now."""
        model = self.model
        return (self.cache.capacity >= capacity and self.max_step_tokens >= max_step_tokens
                and self.max_commit >= max_commit and self.cache.k.dtype == model.dtype
                and self.cache.k.device == model.device and self.cuda_graphs == (
                    cuda_graphs and self.device.type == "cuda" and self.backend.graphable))

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        self._check_room(len(tokens))
        self._apply_commit()
        ids = torch.tensor([list(tokens)], device=self.device)
        slots = torch.arange(self.length, self.length + len(tokens), device=self.device)
        attend = cached(self.cache, slots, prefill_attention(self.length))
        logits = self.model(ids, slots, attend, torch.tensor([len(tokens) - 1], device=self.device))
        self.length += len(tokens)
        return logits[0, 0]

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0) -> StepOutput:
        self._check_room(pattern.num_tokens)
        key = (pattern.shape, len(rows), topk)
        if key not in self._programs:
            self._programs[key] = _StepProgram(self, pattern, len(rows), topk)
        program = self._programs[key]
        src, dst = self._commit if self._commit is not None else self._no_commit()
        self._commit = None
        return program.run(tokens, pattern, rows, self.length, src, dst)

    def commit(self, step_indices: Sequence[int]) -> None:
        count = len(step_indices)
        if not 0 < count <= self.max_commit:
            raise ValueError(f"a commit keeps 1..{self.max_commit} entries, got {count}")
        start = self.length
        self.length += count
        pad = range(count, self.max_commit)  # self-copies past the new L: harmless, the next step overwrites them
        src = [start + int(i) for i in step_indices] + [self.length + j for j in pad]
        dst = [start + j for j in range(count)] + [self.length + j for j in pad]
        self._commit = (src, dst)

    def _no_commit(self) -> tuple[list[int], list[int]]:
        positions = [self.length + j for j in range(self.max_commit)]
        return positions, positions

    def _apply_commit(self) -> None:
        if self._commit is not None:
            src, dst = (torch.tensor(x, device=self.device) for x in self._commit)
            self.cache.move(src, dst)
            self._commit = None

    def _check_room(self, tokens: int) -> None:
        if self.length + max(tokens, self.max_commit) > self.cache.capacity:
            raise ValueError(f"{tokens} tokens at L={self.length} overflow the KV cache "
                             f"({self.cache.capacity} positions)")


class _StepProgram:
    """One step shape: its device input buffer, the forward that reads only that buffer, its graph."""

    def __init__(self, runner: CachedRunner, pattern: StepPattern, num_rows: int, topk: int) -> None:
        self.runner, self.pattern = runner, pattern  # a tree pattern stands for its shape only
        self.topk = min(topk, runner.model.config.vocab_size)
        device = runner.device
        t, k, v = pattern.num_tokens, runner.max_commit, pattern.verify_len if pattern.is_tree else 0
        # inputs: token ids [T] | output rows [R] | L [1] | relative positions [T] | tree_end [V] (tree form)
        #         | commit sources [K] | commit destinations [K]
        self._splits = (t, num_rows, 1, t, v, k, k)
        size = sum(self._splits)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self.staging.numpy()  # writes through to the (pinned) staging buffer
        self._positions_at = t + num_rows + 1
        self.offsets = torch.arange(t, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, tokens, pattern: StepPattern, rows, prefix_len: int, src, dst) -> StepOutput:
        if self.runner.cuda_graphs and self.graph is None:
            # capture with a no-op commit: apply this call's commit first, outside the graph, so the
            # warm-up runs (which compile kernels) change nothing real
            self.runner.cache.move(*(torch.tensor(x, device=self.runner.device) for x in (src, dst)))
            src = dst = self.runner._no_commit()[0]
            self._stage(tokens, pattern, rows, prefix_len, src, dst)
            self._capture(prefix_len)
        self._stage(tokens, pattern, rows, prefix_len, src, dst)
        if self.graph is not None:
            self.graph.replay()
            logits, fetched = self.outputs
        else:
            logits, fetched = self.forward(prefix_len)
        fetched = fetched.cpu()  # the step's one device-to-host copy: argmax [R], then top-k [T, k]
        argmax = fetched[: len(rows)].tolist()
        topk = fetched[len(rows) :].view(-1, self.topk) if self.topk else None
        return StepOutput(logits, argmax, topk)

    def _stage(self, tokens, pattern: StepPattern, rows, prefix_len: int, src, dst) -> None:
        """The step's one host-to-device copy (from pinned memory on CUDA)."""
        at = self._positions_at
        t = len(tokens)
        self._host[:at] = [*tokens, *rows, prefix_len]
        self._host[at : at + t] = pattern.relative_positions.numpy()
        self._host[at + t :] = [*(pattern.tree_end or ()), *src, *dst]
        self.inputs.copy_(self.staging, non_blocking=True)

    def forward(self, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from `self.inputs` alone (`prefix_len` is read only by a non-graphable backend): the rows'
        logits, and the int64 tensor the host fetches (the rows' argmax, then every row's top-k if asked)."""
        runner = self.runner
        tokens, rows, length, positions, tree_end, src, dst = self.inputs.split(self._splits)
        runner.cache.move(src, dst)
        slots = length + self.offsets
        attend = runner.backend.begin_step(self.pattern, prefix_len, length,
                                           tree_end if self.pattern.is_tree else None)
        try:
            # top-k of every row needs the lm_head on every row, not only on the rows read
            logits = runner.model(tokens[None], length + positions, cached(runner.cache, slots, attend),
                                  None if self.topk else rows)[0]
        finally:
            runner.backend.end_step()
        if not self.topk:
            return logits, logits.argmax(-1)
        top = logits.topk(self.topk, dim=-1).indices  # [T, k]
        logits = logits[rows]
        return logits, torch.cat([logits.argmax(-1), top.flatten()])

    def _capture(self, prefix_len: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(prefix_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.runner._graph_pool):
            self.outputs = self.forward(prefix_len)
        self.graph = graph
