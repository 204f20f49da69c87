"""The region a CUDA graph captures (`StepProgram.forward`), run through the CPU emulator: nothing capture forbids,
and a replay on new inputs staged into the program's buffers gives the eager step, for packed steps of plain rows,
trees, top-k, sampling, prompt chunks and padded rows. Each kind of violation has a negative control."""

from __future__ import annotations

import collections
import random
import types

import pytest
import torch
from graph_emulator import KERNELS, CaptureViolation, GraphEmulator, aliases, reachable_tensors, triton_launches
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import needs_interpreter
from lookahead import LookaheadConfig
from lookahead.kernels import StepPattern
from lookahead.loop import RowStep, full_pattern, path_step
from lookahead.loop.sampling import SampleRequest
from lookahead.models import Llama
from lookahead.models.programs import Packing, token_buckets
from lookahead.models.runner import CachedRunner
from lookahead.request import SamplingParams

BLOCKS, BLOCK = 40, 8


def random_tree(size: int, rng: random.Random) -> tuple[int, ...]:
    """A random pre-order forest of `size` nodes, as tree_end."""
    parents = [-1] + [rng.randrange(-1, j) for j in range(1, size)] if size else []
    ends = list(range(1, size + 1))
    for j in reversed(range(size)):  # a node's subtree ends where its last descendant's does
        p = parents[j]
        while p >= 0 and ends[p] < ends[j]:
            ends[p] = ends[j]
            p = parents[p]
    # pre-order needs each parent's subtree to be contiguous: parents chosen among the open path keep it so
    return tuple(ends) if _laminar(ends) else tuple(range(1, size + 1))


def _laminar(ends) -> bool:
    try:
        StepPattern(1, 2, tree_end=tuple(ends))
        return True
    except ValueError:
        return False


def steps_for(runner: CachedRunner, rows: list[int], kinds: list[str], seed: int) -> list[RowStep]:
    """One packed step of these kinds of rows ("plain", "tree", "tree-topk", "sampling", "chunk", "path<T>": a
    decoding step of T tokens, a path), with random lengths, trees and tokens; the same kinds with another seed make
    the same shape."""
    rng = random.Random(seed)
    vocab = runner.model.config.vocab_size
    steps = []
    for row, kind in zip(rows, kinds, strict=True):
        state = runner.rows[row]
        state.length = rng.randrange(1, 60)
        if kind == "plain":
            pattern, outputs = StepPattern(1, 2, 0), [0]
        elif kind == "chunk":
            pattern = path_step(7)
            outputs = [6]
        elif kind.startswith("path"):
            pattern = path_step(int(kind[4:]))
            outputs = [0, pattern.num_tokens - 1]
        else:
            pattern = StepPattern(2, 3, tree_end=random_tree(5, rng))
            outputs = list(range(1, 9))
        tokens = [rng.randrange(vocab) for _ in range(pattern.num_tokens)]
        sample = SampleRequest(SamplingParams(0.8), rng.randrange(2**62), tuple(range(len(outputs)))) \
            if kind == "sampling" else None
        steps.append(RowStep(row, tokens, pattern, outputs, 3 if kind == "tree-topk" else 0, sample,
                             prefill=kind == "chunk"))
    return steps


@torch.inference_mode()  # as generation runs
def emulate(runner: CachedRunner, kinds: list[str], seed: int = 0, positions: int = 80) -> GraphEmulator:
    """Record the step region on inputs A, replay it on inputs B staged into the same program's buffers (another
    draw of trees, lengths and tokens, the same shape); compare the replay's outputs and pool with the eager step
    on B. Each row holds `positions` positions (its random length is below 60, then its step)."""
    rows = [runner.admit([], positions)[0] for _ in kinds]
    for row in rows:
        runner.rows[row].tokens = None
    try:
        a, b = (Packing(steps_for(runner, rows, kinds, s), runner) for s in (seed, seed + 1))
        shape = a.shape(static=True)
        assert b.shape(static=True) == shape
        runner.capture([shape])
        program = runner.programs[shape]
        program.stage(a, runner.scratch_slot)
        program.forward(runner)  # the warm-up runs before a capture
        static = reachable_tensors(runner.model, runner.pool, runner.backend, program)
        with GraphEmulator(static) as graph:
            outputs = program.forward(runner)
        graph.check_escapes(runner, program, outputs=outputs)
        captured = [o.clone() for o in outputs]
        program.stage(b, runner.scratch_slot)
        cache = runner.pool.k.clone(), runner.pool.v.clone()
        graph.replay()
        replayed = [o.clone() for o in outputs] + [runner.pool.k.clone(), runner.pool.v.clone()]
        runner.pool.k.copy_(cache[0])
        runner.pool.v.copy_(cache[1])
        eager = list(program.forward(runner)) + [runner.pool.k, runner.pool.v]
    finally:
        for row in rows:
            runner.release(row)
    real = len(b.head)
    assert not torch.equal(captured[0][:real], eager[0][:real])  # the inputs matter: a replay that did nothing fails
    for got, want in zip(replayed, eager, strict=True):
        if got.ndim == 2 and got.shape[0] == eager[0].shape[0]:  # logits: the padding rows' are never read
            got, want = got[:real], want[:real]
        assert torch.equal(got, want), (got - want).abs().max()
    return graph


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    """fusion ("none", "triton") -> a static runner over the tiny model, made at its first use in the module."""
    made = {}

    def runner(fusion: str) -> CachedRunner:
        if fusion not in made:
            model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="triton", fusion=fusion)
            made[fusion] = CachedRunner(model, BLOCKS, max_step_tokens=16, block_size=BLOCK, max_rows=4)
            made[fusion].static = True
        return made[fusion]

    return runner


SHAPES = {
    "plain": ["plain"],
    "tree": ["tree"],
    "tree-topk": ["tree-topk"],
    "sampling": ["sampling"],
    "batch": ["tree", "plain"],
    "batch-padded-rows": ["tree", "plain", "tree-topk"],
    "chunk-and-steps": ["chunk", "tree", "plain"],
}
# the fused kernels run alike in every row kind: a step of one plain row, the sampling row, and the two steps that
# hold every other kind, padded rows and a prompt chunk (the interpreter makes each case 5-30 s)
FUSED_SHAPES = ["plain", "sampling", "batch-padded-rows", "chunk-and-steps"]


@needs_interpreter
@pytest.mark.parametrize("fusion, name", [("none", name) for name in SHAPES] + [("triton", n) for n in FUSED_SHAPES],
                         ids=lambda x: x)
def test_step_region_is_capturable_and_replays_as_eager(runners, monkeypatch, fusion, name):
    runner = runners(fusion)
    triton_launches(monkeypatch)
    graph = emulate(runner, SHAPES[name])
    layers = runner.model.config.num_hidden_layers
    assert graph.ops.count("triton._lookahead_attn_split") == layers  # the kernel ran inside the region
    if runner.model.fusion == "triton":  # and the fused ones: 2 norms and RoPE per layer, and the final norm
        assert graph.ops.count("triton._add_rms_norm_kernel") == 2 * layers + 1
        assert graph.ops.count("triton._rotary_kernel") == graph.ops.count("triton._silu_mul_kernel") == layers


class _CheckedKernel:
    """A kernel global that, inside an emulated region, checks and records its launch as a capture would (its
    arguments must be the runner's buffers or made in the region) and runs nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if GraphEmulator._active is not None:
                GraphEmulator._active._check_inputs(f"triton.{self.name}", args)
                GraphEmulator._active.ops.append(f"triton.{self.name}")

        return launch


@pytest.mark.parametrize("fusion", ["none", "triton"])
def test_every_token_bucket_captures(tiny_checkpoint, monkeypatch, fusion):
    """Each padded token count of a static step up to the self-tuned ceiling (120 tokens per row: multiples of 16 up
    to 128) and the first powers of two past it (rows of 120 and 128 tokens) records as a CUDA graph capture would:
    no host sync or random draw, every launch on the runner's buffers, nothing made inside kept after (the kernels
    stand in; the replays above run them)."""
    import importlib

    for module, kernels in KERNELS.items():
        launcher = importlib.import_module(f"lookahead.kernels.{module}")
        for kernel in kernels:
            monkeypatch.setattr(launcher, kernel, _CheckedKernel(kernel))
    monkeypatch.setattr(importlib.import_module("lookahead.kernels.fused"), "interpreting", lambda: True)  # CPU tensors
    config = Llama.from_pretrained(tiny_checkpoint("gqa")).config
    with torch.device("meta"):
        model = Llama(config, attn_backend="triton", fusion=fusion)  # the interpreter need not run: nothing launches
    model.to_empty(device="cpu").eval().requires_grad_(False)
    runner = CachedRunner(model, 160, max_step_tokens=128, block_size=BLOCK, max_rows=4)
    runner.static = True
    cases = {t: [t] for t in token_buckets(128)} | {256: [120, 120], 512: [128, 128, 128, 128]}
    with torch.inference_mode():
        for bucket, row_tokens in cases.items():
            rows = [runner.admit([], 160)[0] for _ in row_tokens]
            for row in rows:
                runner.rows[row].length, runner.rows[row].tokens = 17, None
            steps = [RowStep(row, [1] * t, path_step(t), [0, t - 1]) for row, t in zip(rows, row_tokens, strict=True)]
            packing = Packing(steps, runner)
            assert packing.shape(static=True).tokens == bucket
            runner.capture([packing.shape(static=True)])
            program = runner.programs[packing.shape(static=True)]
            program.stage(packing, runner.scratch_slot)
            static = reachable_tensors(runner.model, runner.pool, runner.backend, program)
            with GraphEmulator(static) as graph:
                outputs = program.forward(runner)
            graph.check_escapes(runner, program, outputs=outputs)
            assert graph.ops.count("triton._lookahead_attn_split") == config.num_hidden_layers
            for row in rows:
                runner.release(row)
    assert sorted(shape.tokens for shape in runner.step_shapes) == sorted(cases)


def test_casts_views_and_in_place_writes_replay():
    """A `to` that casts is marked a view op but writes new memory: the replay redoes it (a 16-bit model's RMSNorm
    and RoPE casts), while true views follow their base and in-place ops write their recorded arguments."""
    x, buffer = torch.arange(6.0), torch.zeros(6)
    with torch.inference_mode(), GraphEmulator([x, buffer]) as graph:  # generation's mode, where `to` is one op
        y = (x.half().float() * 2).view(2, 3)
        buffer.add_(y.flatten())
    x.copy_(torch.arange(6.0, 12.0))
    buffer.zero_()
    with torch.inference_mode():
        graph.replay()
    assert torch.equal(y, (torch.arange(6.0, 12.0) * 2).view(2, 3)) and torch.equal(buffer, y.flatten())


def test_the_torch_backend_is_not_capturable(tiny_checkpoint):
    """Negative control, a region that reads per-step host values (the torch backend builds its masks and gathers
    from the rows' lengths and tables on the host, so it is not graphable): the emulator refuses it."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, BLOCKS, max_step_tokens=16, block_size=BLOCK, max_rows=4)
    runner.static = True
    assert not runner.backend.graphable
    with pytest.raises(CaptureViolation, match="host data"):
        emulate(runner, SHAPES["batch"])


@pytest.mark.parametrize("kind, region, message", [
    ("host sync", lambda x, tmp: x.sum().item(), "host sync"),
    ("tolist", lambda x, tmp: x.tolist(), "host sync"),
    ("data-dependent shape", lambda x, tmp: x[x > 0], "data-dependent output shape"),
    ("nonzero", lambda x, tmp: torch.nonzero(x), "data-dependent output shape"),
    ("random", lambda x, tmp: x + torch.rand(3), "random numbers"),
    ("dropout", lambda x, tmp: torch.nn.functional.scaled_dot_product_attention(
        *(x.view(1, 1, 3, 1),) * 3, dropout_p=0.5), "random numbers"),
    ("host data", lambda x, tmp: x + torch.tensor([1.0, 2.0, 3.0]), "host data"),
    ("unheld tensor", lambda x, tmp: x + tmp, "made outside the region"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_violation_fails(kind, region, message):
    static = torch.arange(3.0)
    temporary = torch.ones(3)  # made before the region, but held by nothing the graph keeps alive
    with pytest.raises(CaptureViolation, match=message), GraphEmulator([static]):
        region(static, temporary)
    holder = types.SimpleNamespace(kept=None)
    with GraphEmulator([static]) as graph:
        holder.kept = static * 2  # made in the region, then kept by long-lived state: pool memory
    with pytest.raises(CaptureViolation, match="kept after it"):
        graph.check_escapes(holder)
    graph.check_escapes(holder, outputs=holder.kept)  # unless it is the region's output, read after each replay
    with GraphEmulator([static, temporary]) as graph:  # the same reads of held tensors are fine
        (static * 2 + temporary).sum(0)
    assert graph.ops and not any("lift_fresh" in op for op in graph.ops)


class _CountedKernel:
    """A kernel global that only counts its launches inside an emulated region (the op budget runs no kernel)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if GraphEmulator._active is not None:
                GraphEmulator._active.entries.append(("triton", self.name))
                GraphEmulator._active.ops.append(f"triton.{self.name}")

        return launch


def device_kernels(graph: GraphEmulator) -> list[str]:
    """The recorded ops that launch work on a device: Triton launches, and aten ops that write memory (in place,
    or into a new output); views, aliases (a `to` of the same dtype) and bare allocations launch nothing."""
    kernels = []
    for entry in graph.entries:
        if entry[0] == "triton":
            kernels.append(f"triton.{entry[1]}")
            continue
        _, func, args, kwargs, out = entry
        if str(func).startswith("aten.empty"):
            continue
        if func._schema.is_mutable or not aliases(args, kwargs, out):
            kernels.append(str(func))
    return kernels


EIGHT_B_LAYERS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=4, max_position_embeddings=4096)
# device kernels of one graphed step of the 8B layer structure (32 layers, GQA 32/8) in bf16, counted on the CPU;
# per layer without fusion: 7 GEMMs, 2 KV scatters, 2 attention launches, 2 RMSNorms of 4 ops (cast, norm, cast,
# scale), RoPE's 6 (cat, neg, cat, 2 mul, add), 2 residual adds, SiLU and its product, the output view's copy;
# with fusion "triton": 4 GEMMs (q/k/v one, gate/up one), 2 KV scatters, 2 attention launches, 2 add + RMSNorm
# launches, RoPE's 1 and SiLU-mul's 1 (12, where 29.7 were). The deferred commit's gather and scatter run before the
# region (eagerly, with the previous step's moves), not in it. A budget that fails if the step grows: lower it when a
# fusion lands
BUDGET = {"default-1-4-5": 943, "15-5-15": 943, "default-topk": 945,
          "fused-default-1-4-5": 389, "fused-15-5-15": 389, "fused-default-topk": 391}


@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_interpreter) if name.startswith("fused") else name
                                  for name in BUDGET])
def test_op_budget_of_an_8b_shaped_step(monkeypatch, name):
    """Aten ops and Triton launches per step (no host sync: the emulator forbids them) of a tiny-width model with
    8B's layer structure, counted in the region a CUDA graph captures."""
    import importlib

    from lookahead.models import LlamaConfig
    from lookahead.models.rope import inverse_frequencies

    for module, kernels in KERNELS.items():
        launcher = importlib.import_module(f"lookahead.kernels.{module}")
        for kernel in kernels:
            monkeypatch.setattr(launcher, kernel, _CountedKernel(kernel))
    config = LlamaConfig(**EIGHT_B_LAYERS)
    with torch.device("meta"):
        model = Llama(config, attn_backend="triton", fusion="triton" if name.startswith("fused") else "none")
    model.to(torch.float16).to_empty(device="cpu")  # bf16 casts alike; the interpreter refuses bf16 plans
    model.rope_inv_freq = inverse_frequencies(config.head_dim, config.rope)
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    runner = CachedRunner(model.eval().requires_grad_(False), 16, max_step_tokens=120)
    runner.static = True
    pattern = {"15-5-15": full_pattern(LookaheadConfig(15, 5, 15, form="chains"))}.get(
        name, StepPattern(1, 4, tree_end=tuple(range(1, 16))))
    topk = 3 if "topk" in name else 0
    row = runner.admit([], 200)[0]
    runner.rows[row].tokens = None
    step = RowStep(row, [0] * pattern.num_tokens, pattern, list(range(16)), topk)
    packing = Packing([step], runner)
    runner.capture([packing.shape(static=True)])
    (program,) = runner.programs.values()
    program.stage(packing, runner.scratch_slot)
    program.forward(runner)  # the warm-up a capture does first (it builds the kernel plan)
    with torch.inference_mode(), GraphEmulator(reachable_tensors(model, runner.pool, runner.backend, program)) as g:
        program.forward(runner)
    kernels = device_kernels(g)
    print(name, len(kernels), collections.Counter(kernels).most_common())
    assert kernels.count("triton._lookahead_attn_split") == config.num_hidden_layers
    assert len(kernels) <= BUDGET[name]
    # the whole step, host side included: one device-to-host copy (the fetch), no other host read of a device value
    syncs = SyncCounter()
    monkeypatch.setattr(torch.Tensor, "cpu", syncs.wrap(torch.Tensor.cpu, "cpu"))
    with torch.inference_mode(), syncs:
        runner.step([step])
    assert syncs.counts == {"cpu": 1}, syncs.counts


class SyncCounter(TorchDispatchMode):
    """Counts `Tensor.cpu` calls (through `wrap`) and scalar reads (`_local_scalar_dense`: `.item()`, `int(t)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def wrap(self, method, name: str):
        def counted(tensor, *args, **kwargs):
            self.counts[name] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.data_dependent_output in func.tags:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))
