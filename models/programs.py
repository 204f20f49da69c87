"""A packed step on the host (`Packing`: every row's tokens, positions, write slots, logits rows, sampling) and on the
device (`StepProgram`: one int64 input buffer filled by one host-to-device copy, the forward that reads only it, and
on CUDA its captured graph).

A program is keyed by a `StepShape`. With static steps (CUDA graphs) a step is padded up to its shape's sizes
(`StepShape.of`: its tokens to a multiple of 16 up to 128, then to a power of two; its rows to a power of two), so a
few shapes serve every step and each is captured once: padding tokens are
seen by no row (the kernel computes nothing for them), write their KV entries into a scratch slot no row owns, and
their logits are never read; padding rows hold no tokens. Without static steps a program has the step's exact sizes
and is used once (a CPU's steps: padding would cost real compute).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from lookahead.kernels import cpu_kernels
from lookahead.loop import RowStep, StepOutput
from lookahead.loop.sampling import seed_bits

from .attention import PackedStep, paged

MIN_TOKENS = 8  # the smallest padded token count of a static step
# up to FINE_TOKENS a static step's tokens pad to a multiple of FINE_STEP (18 -> 32, 40 -> 48, 120 -> 128: the steps
# of one to a few rows, where a GPU's step time still grows with T), beyond it to a power of two (few shapes to capture)
FINE_STEP, FINE_TOKENS = 16, 128


class StepShape(NamedTuple):
    """What one step program (one CUDA graph) is keyed by: the tokens fed, the rows, the logits rows (`heads`), the
    top-k fetched per logits row, and whether a row carries a prompt chunk (the kernel's plan for long rows)."""

    tokens: int
    rows: int
    heads: int
    topk: int = 0
    chunk: bool = False

    def padded(self) -> StepShape:
        """The shape a static step of these exact sizes runs: its tokens rounded up to their bucket (`padded_tokens`),
        its rows and logits rows to powers of two."""
        padded = padded_tokens(self.tokens)
        return StepShape(padded, _power_of_two(self.rows), min(padded, max(MIN_TOKENS, _power_of_two(self.heads))),
                         self.topk, self.chunk)


def padded_tokens(tokens: int) -> int:
    """The tokens a static step of `tokens` tokens feeds: at least MIN_TOKENS; up to FINE_TOKENS the next multiple of
    FINE_STEP; beyond, the next power of two."""
    if tokens <= MIN_TOKENS:
        return MIN_TOKENS
    if tokens <= FINE_TOKENS:
        return -(-tokens // FINE_STEP) * FINE_STEP
    return _power_of_two(tokens)


def token_buckets(largest: int) -> list[int]:
    """Every padded token count of static steps of 1 .. `largest` tokens, smallest first."""
    return sorted({padded_tokens(t) for t in range(1, largest + 1)})


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Packing:
    """One packed step laid out on the host: tokens, positions (L + relative), write slots (L + step index, through
    the row's table), the logits rows (`head`: a top-k row's every token, else its output rows), each row's offsets,
    and sampling's rows grouped by their settings. `runner` gives the rows' tables and the slot arithmetic."""

    def __init__(self, steps: Sequence[RowStep], runner) -> None:
        self.steps = steps
        tokens, positions, slots, head, tree_end = [], [], [], [], []
        starts, tables, lengths, patterns = [], [], [], []
        self.heads: list[tuple[list[int], int]] = []  # per step: its output rows' places in `head`, its top-k start
        self.samples: dict = {}  # params -> (head places, seeds, absolute positions)
        limit = max(runner.max_step_tokens, runner.prefill_chunk)
        rows, block_size = runner.rows, runner.block_size  # (properties: read once, not once a row)
        for s in steps:
            row, pattern = rows[s.row], s.pattern
            t, start, length = len(s.tokens), len(tokens), row.length
            branch = pattern.lookahead_len
            if t != branch + pattern.verify_len:
                raise ValueError(f"row {s.row}: {t} tokens for a pattern of {pattern.num_tokens}")
            if t > limit:
                raise ValueError(f"row {s.row}: a step of {t} tokens exceeds the runner's {limit}")
            if length + t > len(row.blocks) * block_size:
                raise ValueError(f"row {s.row}: {t} tokens at L={length} overflow its "
                                 f"{len(row.blocks) * block_size} positions")
            tokens += s.tokens
            positions += map(length.__add__, pattern.position_list)  # L + each relative position
            slots += slot_run(row.blocks, block_size, length, t)
            tree_end += [0] * branch
            tree_end += pattern.node_ends
            first = len(head)
            if s.topk:
                head += range(start, start + t)
                places = [first + r for r in s.rows]
            else:
                head += [start + r for r in s.rows]
                places = list(range(first, first + len(s.rows)))
            self.heads.append((places, first if s.topk else -1))
            if s.sample is not None:
                group = self.samples.setdefault(s.sample.params, ([], [], []))
                group[0].extend(places)
                group[1].extend([seed_bits(s.sample.seed)] * len(places))
                group[2].extend(s.sample.positions)
            starts.append(start)
            tables.append(row.blocks)
            lengths.append(length)
            patterns.append(pattern)
        self.tokens, self.positions, self.slots, self.head, self.tree_end = tokens, positions, slots, head, tree_end
        self.step = PackedStep(lengths, patterns, tables, starts, runner.block_size, len(tokens))
        self.topk = max((s.topk for s in steps), default=0)
        self.chunk = any(s.prefill for s in steps) and max(len(s.tokens) for s in steps) > runner.max_step_tokens

    def shape(self, static: bool) -> StepShape:
        exact = StepShape(len(self.tokens), len(self.steps), len(self.head), self.topk, self.chunk)
        return exact.padded() if static else exact

    def outputs(self, logits: torch.Tensor, host: np.ndarray, topk: int) -> list[StepOutput]:
        """One `StepOutput` per step from the logits rows [H, V] (H padded) and the fetched int64 array: argmax [H],
        top-k [H, k] and winners (per sampling group, in order). Each row's logits are taken from `logits` when read
        (`PackedOutput`)."""
        h = logits.shape[0]
        argmax = host[:h].tolist()
        # every row's top-k: views of the fetched array (no copy), as the int64 tensors `StepOutput.topk` holds
        top = host[h : h + h * topk].reshape(h, topk) if topk else None
        winners, offset = {}, h + h * topk
        for heads, _, _ in self.samples.values():
            for place, token in zip(heads, host[offset : offset + len(heads)].tolist(), strict=True):
                winners[place] = token
            offset += len(heads)
        outputs = []
        for s, (places, top_start) in zip(self.steps, self.heads, strict=True):
            row_top = None if top_start < 0 else torch.from_numpy(top[top_start : top_start + len(s.tokens)])
            sampled = None if s.sample is None else [winners[p] for p in places]
            outputs.append(PackedOutput(logits, places, [argmax[p] for p in places], row_top, sampled))
        return outputs


class PackedOutput(StepOutput):
    """A row's `StepOutput` of a packed step, whose `logits` rows are taken from the step's logits on first read: most
    rows never read them (verification reads the argmax; a grammar or log-probabilities read them), and a slice or
    gather per row costs more than the rest of a row's unpacking. Read, they are what the step's logits hold until
    the model's next step (as `StepOutput.logits` says)."""

    def __init__(self, step_logits: torch.Tensor, places: list[int], argmax: list[int], topk: torch.Tensor | None,
                 sampled: list[int] | None) -> None:
        self._step_logits, self._places, self._logits = step_logits, places, None
        self.argmax, self.topk, self.sampled = argmax, topk, sampled

    @property
    def logits(self) -> torch.Tensor:  # [R, V]: a view where the rows are one run of the step's logits, else a copy
        if self._logits is None:
            places, source = self._places, self._step_logits
            if _is_run(places):
                self._logits = source[places[0] : places[0] + len(places)]
            else:  # (a lookahead row's input token read twice, say)
                self._logits = source[torch.from_numpy(np.array(places, dtype=np.int64)).to(source.device)]
        return self._logits


class StepProgram:
    """One step shape on the device: the input buffer (sections at fixed offsets), the forward that reads only it,
    and with `graphs` its CUDA graph, captured on first use after two warm-up runs and replayed after. It keeps no
    reference to its runner (passed to each call), so a dropped runner frees its pool and graphs at once."""

    def __init__(self, runner, shape: StepShape, table_width: int,
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """buffers: an input buffer and its staging buffer, at least `program_size(shape, table_width)` long, that the
        program's take the start of (None: its own). Exact-size programs share one such pair: a CPU's decoding
        steps rarely repeat their sizes, and allocating a program's buffers costs more than staging them."""
        self.shape, self.table_width = shape, table_width
        self._sizes = _sections(shape, table_width)
        total, device = sum(self._sizes.values()), runner.device
        if buffers is None:
            buffers = program_buffers(total, device)
        self.inputs, self.staging = buffers[0][:total], buffers[1][:total]
        self._host = self.staging.numpy()  # writes through to the (pinned) staging buffer
        self.views, self._offsets, offset = {}, {}, 0
        for name, size in self._sizes.items():
            self.views[name] = self.inputs[offset : offset + size]
            self._offsets[name] = offset
            offset += size
        self.views["block_table"] = self.views["block_table"].view(shape.rows, table_width)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step: PackedStep | None = None  # the host's view of the step staged last (what a torch backend reads)

    def stage(self, packing: Packing, scratch: int) -> None:
        """The step's one host-to-device copy (from pinned memory on CUDA), padded to the shape: padding tokens write
        the scratch slot and belong to no row; padding rows hold no tokens."""
        shape, step, host, at = self.shape, packing.step, self._host, self._offsets
        real = len(packing.tokens)

        def put(name: str, values, pad: int) -> None:  # a section: its values, then its padding value
            start, size = at[name], self._sizes[name]
            host[start : start + len(values)] = values
            host[start + len(values) : start + size] = pad

        put("tokens", packing.tokens, 0)
        put("positions", packing.positions, 0)
        put("slots", packing.slots, scratch)
        put("tree_end", packing.tree_end, 0)
        put("head", packing.head, 0)
        put("cu_seqlens", [*step.starts, real], real)
        put("prefix_len", step.lengths, 0)
        put("window", [p.window for p in step.patterns], 1)
        put("ngram", [p.ngram for p in step.patterns], 2)
        table = host[at["block_table"] :].reshape(shape.rows, self.table_width)
        table.fill(0)  # one fill, then each row's blocks (not a fill a row past its blocks)
        for b, blocks in enumerate(step.tables):
            table[b, : len(blocks)] = blocks
        self.inputs.copy_(self.staging, non_blocking=True)
        self.step = PackedStep(step.lengths, step.patterns, step.tables, step.starts, step.block_size, shape.tokens)

    def forward(self, runner) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from the input buffer alone: the logits rows [H, V], and the int64 [H (+ H x k)] the host fetches
        (each logits row's argmax, then its top-k if asked). This is the region a CUDA graph captures."""
        v = self.views
        attend = runner.backend.begin_step(self.step, v)
        try:
            logits = runner.model.step_forward(v["tokens"][None], v["positions"][None],
                                               paged(runner.pool, v["slots"], attend), v["head"])[0]
        finally:
            runner.backend.end_step()
        k = min(self.shape.topk, logits.shape[-1])  # a vocabulary may be smaller than k
        if getattr(runner.model, "uses_cpu_kernels", False):  # one pass (torch's argmax and topk: ~1 ms each a step)
            return logits, cpu_kernels.top_ids(logits, k)
        if not k:
            return logits, logits.argmax(-1)
        return logits, torch.cat([logits.argmax(-1), logits.topk(k, dim=-1).indices.flatten()])

    def run(self, runner, packing: Packing, graphs: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.stage(packing, runner.scratch_slot)
        if not graphs:
            return self.forward(runner)
        if self.graph is None:
            self.capture(runner)
        self.graph.replay()
        return self.outputs

    def capture(self, runner) -> None:
        """Two warm-up runs on a side stream (they compile the kernels), then the capture, of what is staged. Called
        under the runner's device binding."""
        side = torch.cuda.Stream(device=runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(runner)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a capture mid-serving must not fail on what other threads do meanwhile
        with torch.cuda.graph(graph, pool=runner.graph_pool, capture_error_mode="thread_local"):
            self.outputs = self.forward(runner)
        self.graph = graph


def _sections(shape: StepShape, table_width: int) -> dict[str, int]:
    """The input buffer's sections and their sizes, in order."""
    t, b, h = shape.tokens, shape.rows, shape.heads
    return {"tokens": t, "positions": t, "slots": t, "tree_end": t, "head": h, "cu_seqlens": b + 1, "prefix_len": b,
            "window": b, "ngram": b, "block_table": b * table_width}


def program_size(shape: StepShape, table_width: int) -> int:
    """The int64 elements of a program's input buffer."""
    return sum(_sections(shape, table_width).values())


def program_buffers(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An input buffer of `size` int64 on `device` and its host staging buffer (pinned on CUDA)."""
    with torch.inference_mode(False):  # normal tensors: staged into whether or not the caller is in inference mode
        inputs = torch.zeros(size, dtype=torch.int64, device=device)
        staging = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
    return inputs, staging


def _is_run(places: list[int]) -> bool:
    """Whether the logits rows are consecutive, first to last."""
    return places == list(range(places[0], places[0] + len(places)))


def slot_run(blocks: Sequence[int], block_size: int, start: int, count: int) -> list[int]:
    """The pool slots of positions start .. start + count - 1 of a row with these blocks: a run of consecutive
    slots per block (a step spans one or two), not a table look-up per token."""
    out: list[int] = []
    end = start + count
    while start < end:
        block, offset = divmod(start, block_size)
        n = min(block_size - offset, end - start)
        first = blocks[block] * block_size + offset
        out += range(first, first + n)
        start += n
    return out


def table_width(max_positions: int, block_size: int) -> int:
    """Blocks a row's table holds at most."""
    return math.ceil(max_positions / block_size)
