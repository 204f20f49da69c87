"""`CachedRunner`: a `Llama` with its paged KV cache, speaking the engine's `RowModel` protocol (packed steps of rows).

Rows are sequences, each with a block table over the pool (`paging.RowTables` keeps the tables, `paging.BlockPool` the
blocks' accounting, `KVPool` the memory). A packed step lays every row's step tokens end to end; one forward pass runs
them all, each token at its row's L + relative position, its KV entry written at its row's L + step index (through the
row's table), attending to its row's prefix and to what its row's pattern lets it see. It returns each row's requested
logits with their argmax (and, when asked, every token's top-k and the rows' sampled tokens), fetched by one
device-to-host copy.

A commit is deferred: the accepted entries' moves (slot to slot, any row) run at the start of the next step, as one
gather over every layer. Once a row's committed positions fill a block, the block is keyed by its tokens
(`BlockPool.publish`), so a later sequence that begins with the same tokens takes the block instead of prefilling it:
a conversation's next turn, requests that share a system prompt. The entries in it are what a prefill of those tokens
at those positions computes (docs/DESIGN.md, "Paged KV").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from lookahead.kernels import StepPattern, device_binding
from lookahead.loop import RowStep, StepOutput
from lookahead.loop.sampling import SampleRequest, sample_positions

from .attention import Attend, InvariantBackend, TorchBackend, TritonBackend
from .config import LlamaConfig
from .kv_cache import KVPool, KVShape
from .paging import BlockPool, Row, RowTables
from .programs import MIN_TOKENS, Packing, StepProgram, StepShape, program_buffers, program_size, table_width

BLOCK_SIZE = 16  # positions per block
PREFILL_CHUNK = {"cpu": 512, "cuda": 2048}  # prompt tokens one step carries for one row at most
EXACT_PROGRAMS = 32  # exact-size step programs kept for reuse


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


class CachedRunner:
    """Packed steps over a pool of `num_blocks` blocks of `block_size` positions; rows of at most `max_step_tokens`
    step tokens. See the module docstring."""

    def __init__(self, model: StepForward, num_blocks: int, max_step_tokens: int = 1, block_size: int = BLOCK_SIZE,
                 cuda_graphs: bool = False, max_rows: int = 1) -> None:
        cfg = model.config
        self.model, self.device, self.fusion = model, model.device, model.fusion
        self.max_step_tokens, self.max_rows = max_step_tokens, max_rows
        self.tables = RowTables(BlockPool(num_blocks, block_size))
        self.pool = KVPool(KVShape.of(cfg), num_blocks, block_size, model.dtype, model.device)
        if backend_name(model) == "invariant":
            kernel = "triton" if model.attn_backend == "triton" else "cpu" if model.uses_cpu_kernels else "torch"
            self.backend = InvariantBackend(model.device, kernel)
        elif model.attn_backend == "triton":
            self.backend = TritonBackend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, model.dtype,
                                         model.device)
        else:
            self.backend = TorchBackend(model.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.backend.graphable
        self.static = self.device.type == "cuda"  # steps padded to a few shapes (`StepShape`): one program each
        self.programs: dict[StepShape, StepProgram] = {}
        self._exact: dict[tuple[StepShape, int], StepProgram] = {}  # exact-size programs, least recently used first
        self._exact_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers they share
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.prefill_chunk = PREFILL_CHUNK.get(self.device.type, PREFILL_CHUNK["cpu"])
        self.table_width = table_width(cfg.max_position_embeddings + max(max_step_tokens, self.prefill_chunk),
                                       block_size)
        self.backend.resize(self.pool, max_rows, (max_step_tokens, self.prefill_chunk))
        self.prefix_cache = True  # prompts take the cached blocks they begin with (False: every prompt prefills whole)
        self._moves: tuple[list[int], list[int]] = ([], [])  # deferred commits: source and destination slots
        self.weights = weights_version(model)
        self._busy = False  # inside a step or a commit: still set on the next call if one was interrupted

    @property
    def blocks(self) -> BlockPool:
        return self.tables.blocks

    @property
    def rows(self) -> dict[int, Row]:
        return self.tables.rows

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def capacity(self) -> int:
        """Positions the pool holds, all rows together."""
        return self.blocks.num_blocks * self.block_size

    def serves(self, model) -> bool:
        """Whether this runner still fits the model as it is now (its dtype, device, backend and fusion)."""
        return (self.pool.k.dtype == model.dtype and self.pool.k.device == model.device
                and self.backend.name == backend_name(model) and self.fusion == model.fusion)

    def grow(self, num_blocks: int, max_rows: int, max_step_tokens: int) -> None:
        """Make room for at least `num_blocks` blocks, `max_rows` rows and steps of `max_step_tokens` tokens, keeping
        every row and cached prefix (the pool's contents are copied into the larger one)."""
        if num_blocks > self.blocks.num_blocks:
            cfg, old = self.model.config, self.pool
            # refused before anything changes if it cannot fit
            new = KVPool(KVShape.of(cfg), num_blocks, self.block_size, old.k.dtype, old.k.device)
            new.k[:, :, : old.k.shape[2]] = old.k
            new.v[:, :, : old.v.shape[2]] = old.v
            self.pool = new
            self.blocks.grow(num_blocks)
            self.programs.clear()  # their graphs read the old pool
        self.max_rows = max(self.max_rows, max_rows)  # (after the pool: a pool refused changes nothing)
        self.max_step_tokens = max(self.max_step_tokens, max_step_tokens)
        self.backend.resize(self.pool, self.max_rows, (self.max_step_tokens, self.prefill_chunk))

    # ----- rows -----

    def admit(self, prompt: Sequence[int], positions: int) -> tuple[int, int] | None:
        """A row for `prompt` with room for `positions` positions (see `RowModel.admit`): the longest run of cached full
        blocks that begins the prompt (never its last token's), then new blocks for the rest; None while the pool
        lacks them. ValueError if it could never fit."""
        need = -(-positions // self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"{positions} positions need {need} blocks of {self.block_size}; the KV cache holds "
                             f"{self.blocks.num_blocks}: shorten the prompt or ask for fewer tokens")
        if len(self.rows) >= self.max_rows:
            return None
        self._check_weights()
        self._check_interrupted()
        return self.tables.admit(prompt, need, self.prefix_cache)

    def release(self, row: int) -> None:
        """The row leaves: its blocks go back to the pool (its keyed ones stay cached for later prefix matches)."""
        self.tables.release(row)

    def commit(self, row: int, step_indices: Sequence[int]) -> None:
        """Keep these step indices' entries of the row's last step at L, L + 1, ... (moved at the next step's start),
        and key the blocks they fill."""
        self._check_interrupted()
        self._busy = True
        state = self.rows[row]
        start = state.length
        src, dst = self._moves
        for j, index in enumerate(step_indices):
            if index != j:
                src.append(self.slot(state, start + index))
                dst.append(self.slot(state, start + j))
        state.length += len(step_indices)
        if state.tokens is not None:
            state.tokens += [state.step_tokens[i] for i in step_indices]
            self.tables.publish(state)
        self._busy = False

    @property
    def scratch_slot(self) -> int:
        return self.pool.scratch_slot

    def slot(self, row: Row, position: int) -> int:
        return self.tables.slot(row, position)

    def clear_cache(self) -> None:
        """Forget the cached prefixes (the weights changed)."""
        self.tables.clear_cache()

    def _check_interrupted(self) -> None:
        """A step or commit that an exception (a KeyboardInterrupt, say) cut midway may have written part of its
        entries or lost its moves: no cached prefix is trusted after it (the rows it served were released by their
        engine)."""
        if self._busy:
            self.clear_cache()
            self._moves = ([], [])
            self._busy = False

    def _check_weights(self) -> None:
        """Weights changed in place since the cached entries were computed: forget them."""
        version = weights_version(self.model)
        if version != self.weights:
            self.clear_cache()
            self.weights = version

    # ----- the packed step -----

    def step(self, steps: Sequence[RowStep]) -> list[StepOutput]:
        """Run every row's step in one forward pass; one `StepOutput` per step (see `RowModel.step`). With static
        steps it runs padded to its `StepShape`'s program (captured as a CUDA graph with `cuda_graphs`); otherwise
        at its exact size."""
        self._check_interrupted()
        self._busy = True
        packing = Packing(steps, self)
        # decoding steps run padded to a few shapes (graphed on CUDA); steps with a prompt chunk run at their size
        static = self.static and not any(s.prefill for s in steps)
        shape = packing.shape(static)
        program = self.programs.get(shape) if static else self._exact_program(shape, packing)
        if program is None:
            program = self.programs[shape] = StepProgram(self, shape, self.table_width)
        with torch.inference_mode(), device_binding(self.device):  # any thread may drive it (an engine's own)
            self._apply_moves()
            logits, fetched = program.run(self, packing, self.cuda_graphs and static)
            fetched = [fetched]
            for params, (heads, seeds, positions) in packing.samples.items():
                # after the graph, from its logits: each sampled row as a sequence of one, its seed, its position
                fetched.append(sample_positions(logits[torch.tensor(heads, device=self.device)][:, None], params,
                                                torch.tensor(seeds, device=self.device),
                                                torch.tensor(positions, device=self.device)[:, None])[:, 0])
            host = torch.cat(fetched).cpu().numpy()  # the step's one device-to-host copy
        for s in steps:
            self.rows[s.row].step_tokens = s.tokens
        self._busy = False
        return packing.outputs(logits, host, min(shape.topk, logits.shape[-1]))

    def _exact_program(self, shape: StepShape, packing: Packing) -> StepProgram:
        """The program of an exact-size step: its buffers sized to it, kept for the next step of the same sizes (the
        few most recent: a CPU's decoding steps repeat their sizes often, and making one costs more than staging it)."""
        key = (shape, max(len(t) for t in packing.step.tables))
        program = self._exact.pop(key, None)
        if program is None:
            # its buffers are the start of one shared pair (grown to the largest step so far): each step stages its
            # whole input before its forward, so programs used one at a time can share them
            size, held = program_size(shape, key[1]), self._exact_buffers
            if held is None or held[0].numel() < size:  # doubled: growing steps reallocate a few times only
                self._exact_buffers = program_buffers(max(size, 2 * held[0].numel() if held else 0), self.device)
            program = StepProgram(self, shape, key[1], self._exact_buffers)
            if len(self._exact) >= EXACT_PROGRAMS:
                del self._exact[next(iter(self._exact))]  # the least recently used
        self._exact[key] = program
        return program

    def _apply_moves(self) -> None:
        """The deferred commits: every accepted entry to its place, one gather and one scatter over every layer."""
        src, dst = self._moves
        if src:
            self._moves = ([], [])
            self.pool.move(index_tensor(src, self.device), index_tensor(dst, self.device))

    def round_up(self, tokens: int) -> int:
        """The tokens a step of `tokens` tokens feeds (padded to its static shape): what it costs."""
        return StepShape(tokens, 1, 1).padded().tokens if self.static else tokens

    @property
    def step_shapes(self) -> list[StepShape]:
        """The static step shapes prepared so far, one program (one CUDA graph on CUDA) each."""
        return list(self.programs)

    def decode_shapes(self, rows: int, step_tokens: int, topk: int) -> list[StepShape]:
        """Every static shape a decoding step of up to `rows` rows of up to `step_tokens` tokens each can have: per
        padded row count, each padded token count from its rows' one token each to their full steps (every logits
        row's top-k fetched when `topk`: a lookahead row's logits rows are all its tokens; else one per row)."""
        shapes = set()
        for real in range(1, rows + 1):
            for tokens in range(real, real * step_tokens + 1):
                heads = tokens if topk else real
                shapes.add(StepShape(tokens, real, heads, topk).padded())
        return sorted(shapes)

    def capture(self, shapes: Sequence[StepShape]) -> None:
        """Prepare the program of each static step shape now (with CUDA graphs: compile its kernels and capture its
        graph), so that no request pays for it mid-way. Runs placeholder steps of padding alone (every token writes
        the scratch slot; no row's entries change)."""
        if not self.static:
            raise ValueError("capture prepares static step shapes; this runner steps at exact sizes (static=False)")
        for shape in shapes:
            if not isinstance(shape, StepShape):
                raise TypeError(f"shapes must hold StepShape values, got {type(shape).__name__}")
            if shape.tokens > max(self.max_step_tokens, self.prefill_chunk) * max(shape.rows, 1) + MIN_TOKENS:
                raise ValueError(f"a StepShape of {shape.tokens} tokens exceeds this runner's steps")
        with torch.inference_mode(), device_binding(self.device):
            self._apply_moves()
            for shape in shapes:
                program = self.programs.setdefault(shape, StepProgram(self, shape, self.table_width))
                if program.graph is not None or not self.cuda_graphs and self.device.type != "cuda":
                    continue
                program.stage(Packing([], self), self.scratch_slot)
                if self.cuda_graphs:
                    program.capture(self)
                else:  # the kernels compile
                    program.forward(self)

    # ----- one sequence (lookahead parallelism, timing) -----

    def sequence(self, positions: int) -> RowSequence:
        """A new row as a one-sequence `StepModel` (with room for `positions` positions), for drivers that decode one
        sequence by themselves (lookahead parallelism)."""
        return RowSequence(self, positions)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of a list of indices on `device`: through numpy, since `torch.tensor` of a Python list costs
    about 0.15 us an element (a commit's moves, every step, are a few hundred) and numpy's conversion a tenth of it."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def backend_name(model) -> str:
    """The attention backend a runner for this model uses: "invariant" in the batch-invariant mode, else its own."""
    return "invariant" if getattr(model, "batch_invariant", False) else model.attn_backend


def weights_version(model) -> int:
    """A number that changes whenever a parameter of the model is written in place (torch's version counters)."""
    return sum(p._version for p in model.parameters())


class RowSequence:
    """One row of a runner as a one-sequence `StepModel` (prefill, step, commit), with the KV hand-over lookahead
    parallelism needs (`step_entries`, `empty_entries`, `append_entries`). Call `close` when done."""

    def __init__(self, runner: CachedRunner, positions: int) -> None:
        self.runner, self.device = runner, runner.device
        admitted = runner.admit([], positions)
        if admitted is None:
            raise ValueError("the KV cache has no room for one more sequence")
        self.row, _ = admitted

    @property
    def length(self) -> int:
        """L: the positions before the next step's."""
        return self.runner.rows[self.row].length

    @length.setter
    def length(self, value: int) -> None:
        """Move L (for timing steps at a cache length: the entries before it are placeholders, never keyed)."""
        row = self.runner.rows[self.row]
        if not 0 <= value <= len(row.blocks) * self.runner.block_size:
            raise ValueError(f"length must be in 0..{len(row.blocks) * self.runner.block_size}, got {value}")
        row.length, row.tokens = value, None

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """The prompt in chunks of the runner's `prefill_chunk`; the logits [V] of its last token."""
        chunk = self.runner.prefill_chunk
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            (output,) = self.runner.step([RowStep.chunk(self.row, part)])
            self.runner.commit(self.row, range(len(part)))
        return output.logits[0]

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0,
             sample: SampleRequest | None = None) -> StepOutput:
        return self.runner.step([RowStep(self.row, tokens, pattern, rows, topk, sample)])[0]

    def commit(self, step_indices: Sequence[int]) -> None:
        self.runner.commit(self.row, step_indices)

    def step_entries(self, step_indices: Sequence[int]) -> torch.Tensor:
        """The KV entries [2, layers, Hkv, n, D] the last step wrote at these step indices (before its commit)."""
        row = self.runner.rows[self.row]
        slots = [self.runner.slot(row, row.length + int(i)) for i in step_indices]
        return self.runner.pool.entries(torch.tensor(slots, device=self.device))

    def empty_entries(self, count: int) -> torch.Tensor:
        """A tensor to receive `count` KV entries into, shaped as `step_entries` returns them."""
        k = self.runner.pool.k
        return torch.empty(2, k.shape[0], k.shape[1], count, k.shape[3], dtype=k.dtype, device=self.device)

    def append_entries(self, entries: torch.Tensor) -> None:
        """Keep KV entries [2, layers, Hkv, n, D] computed elsewhere at L, L + 1, ... (after the pending commits) and
        grow L by n."""
        runner = self.runner
        row = runner.rows[self.row]
        src, dst = runner._moves
        if src:
            runner.pool.move(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
            runner._moves = ([], [])
        count = entries.shape[3]
        slots = [runner.slot(row, row.length + j) for j in range(count)]
        runner.pool.put_entries(torch.tensor(slots, device=self.device), entries.to(self.device, runner.pool.k.dtype))
        row.length += count
        row.tokens = None  # entries whose tokens this runner was not told: nothing of this row is keyed from here

    def close(self) -> None:
        self.runner.release(self.row)
