"""`CachedRunner`: a `Llama` with its KV cache, speaking the decode loop's `StepModel` protocol.

A step reads everything that changes from one step to the next (token ids, output rows, L, the
previous verdict's commit) from one device buffer, filled by one host-to-device copy; it returns
the requested rows' logits and their argmax, fetched by one device-to-host copy. Shapes depend only
on the step pattern, so on CUDA each pattern's step is captured once as a CUDA graph and replayed.
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
        self.can_graph = self.device.type == "cuda" and self.backend.graphable
        self.cuda_graphs = cuda_graphs and self.can_graph  # may be switched between generations
        self._graph_pool = torch.cuda.graph_pool_handle() if self.can_graph else None
        self._programs: dict[tuple[StepPattern, int], _StepProgram] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the sequence (the buffers and captured graphs stay for the next one)."""
        self.length = 0
        self._commit: tuple[list[int], list[int]] | None = None

    def fits(self, capacity: int, max_step_tokens: int, max_commit: int) -> bool:
        """Whether this runner can serve a generation of that size on the model as it is now."""
        model = self.model
        return (self.cache.capacity >= capacity and self.max_step_tokens >= max_step_tokens
                and self.max_commit >= max_commit and self.cache.k.dtype == model.dtype
                and self.cache.k.device == model.device and self.backend.name == model.attn_backend)

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        self._check_room(len(tokens))
        self._apply_commit()
        ids = torch.tensor([list(tokens)], device=self.device)
        slots = torch.arange(self.length, self.length + len(tokens), device=self.device)
        attend = cached(self.cache, slots, prefill_attention(self.length))
        logits = self.model(ids, slots, attend, torch.tensor([len(tokens) - 1], device=self.device))
        self.length += len(tokens)
        return logits[0, 0]

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int]) -> StepOutput:
        self._check_room(pattern.num_tokens)
        key = (pattern, len(rows))
        if key not in self._programs:
            self._programs[key] = _StepProgram(self, pattern, len(rows))
        program = self._programs[key]
        src, dst = self._commit if self._commit is not None else self._no_commit()
        self._commit = None
        return program.run(tokens, rows, self.length, src, dst)

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

    def __init__(self, runner: CachedRunner, pattern: StepPattern, num_rows: int) -> None:
        self.runner, self.pattern = runner, pattern
        device = runner.device
        t, k = pattern.num_tokens, runner.max_commit
        # inputs: token ids [T] | output rows [R] | L [1] | commit sources [K] | commit destinations [K]
        self._splits = (t, num_rows, 1, k, k)
        size = sum(self._splits)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self.staging.numpy()  # writes through to the (pinned) staging buffer
        self.relative_positions = pattern.relative_positions.to(device)
        self.offsets = torch.arange(t, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, tokens, rows, prefix_len: int, src, dst) -> StepOutput:
        graphed = self.runner.cuda_graphs
        if graphed and self.graph is None:
            # capture with a no-op commit: apply this call's commit first, outside the graph, so the
            # warm-up runs (which compile kernels) change nothing real
            self.runner.cache.move(*(torch.tensor(x, device=self.runner.device) for x in (src, dst)))
            src = dst = self.runner._no_commit()[0]
            self._stage(tokens, rows, prefix_len, src, dst)
            self._capture(prefix_len)
        self._stage(tokens, rows, prefix_len, src, dst)
        if graphed:
            self.graph.replay()
            logits, argmax = self.outputs
        else:
            logits, argmax = self.forward(prefix_len)
        return StepOutput(logits, argmax.tolist())

    def _stage(self, tokens, rows, prefix_len: int, src, dst) -> None:
        """The step's one host-to-device copy (from pinned memory on CUDA)."""
        self._host[:] = [*tokens, *rows, prefix_len, *src, *dst]
        self.inputs.copy_(self.staging, non_blocking=True)

    def forward(self, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from `self.inputs` alone (`prefix_len` is read only by a non-graphable backend)."""
        runner = self.runner
        tokens, rows, length, src, dst = self.inputs.split(self._splits)
        runner.cache.move(src, dst)
        slots = length + self.offsets
        attend = runner.backend.begin_step(self.pattern, prefix_len, length)
        try:
            logits = runner.model(tokens[None], length + self.relative_positions,
                                  cached(runner.cache, slots, attend), rows)[0]
        finally:
            runner.backend.end_step()
        return logits, logits.argmax(-1)

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
