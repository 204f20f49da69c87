"""What a CPU can prove of the GPU path: device binding (CUDA faked), the load's peak memory, a rebuilt runner's
memory (weak references, no garbage collection), the lifetime of a step's logits, and the kernel's tile table."""

from __future__ import annotations

import contextlib
import gc
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lookahead.kernels.triton_attention as launcher
import lookahead.models.runner as runner_module
from helpers import needs_interpreter
from lookahead import LookaheadConfig
from lookahead.kernels import PagedAttentionPlan, StepAttentionPlan, StepPattern, device_binding
from lookahead.kernels.triton_attention import TilePlan, tile_plan
from lookahead.models import Llama
from lookahead.models.runner import CachedRunner, StepShape


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU storages allocated by the ops it sees and still alive; `peak` is the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.seen:
                    self.seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_load_peaks_near_two_bytes_per_parameter(tiny_checkpoint, dtype):
    """16-bit loading allocates each parameter once, at its dtype: no fp32 copy of the model (which peaks >= 4)."""
    folder = tiny_checkpoint("deep", num_hidden_layers=12)
    with LiveBytes() as memory:
        model = Llama.from_pretrained(folder, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert model.dtype == dtype
    # the model's 2 bytes per parameter, plus one tensor's transients while it loads (file copy, cast, finite check)
    assert memory.peak <= 2 * params + 12 * largest, memory.peak / params
    assert memory.peak / params < 2.5


def test_a_dropped_runner_is_freed_without_garbage_collection(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    runner = CachedRunner(model, 8, max_step_tokens=18)
    runner.static = True
    sequence = runner.sequence(64)
    sequence.prefill([1, 2, 3])
    sequence.step([5, 6, 7, 8, 9, 10, 11, 12, 13], StepPattern(3, 4, 0), [0, 6, 7, 8])
    assert runner.programs
    runner_ref, cache_ref = weakref.ref(runner), weakref.ref(runner.pool.k)
    gc.disable()
    try:
        del runner, sequence
        assert runner_ref() is None and cache_ref() is None
    finally:
        gc.enable()


class FakeCuda:
    """Stands in for the current-device state of torch.cuda: records which device each CUDA call happened under."""

    def __init__(self) -> None:
        self.current: torch.device | None = None
        self.events: list[tuple[str, torch.device | None]] = []

    @contextlib.contextmanager
    def bind(self, device):
        previous, self.current = self.current, torch.device(device)
        try:
            yield
        finally:
            self.current = previous

    def record(self, what: str):
        self.events.append((what, self.current))


class RecordedLaunch:
    def __init__(self, fake: FakeCuda, name: str) -> None:
        self.fake, self.name = fake, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fake.record(self.name)


def test_kernel_launches_run_under_the_plan_device(monkeypatch):
    """A plan on cuda:1 launches both kernels with cuda:1 current (Triton launches on the current device), whatever
    the current device was, and leaves it as it was."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "device", fake.bind)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132))
    for name in ("_lookahead_attn_split", "_lookahead_attn_merge"):
        monkeypatch.setattr(launcher, name, RecordedLaunch(fake, name))
    pattern = StepPattern(3, 4, 3)
    plan = StepAttentionPlan(pattern, batch=1, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float16,
                             device=torch.device("cuda", 1), max_len=64)
    q = torch.zeros(1, 4, pattern.num_tokens, 16, dtype=torch.float16)
    k = torch.zeros(1, 2, 64 + pattern.num_tokens, 16, dtype=torch.float16)
    plan(q, k, k, torch.zeros(1, dtype=torch.int64))
    assert fake.events == [(name, torch.device("cuda", 1)) for name in ("_lookahead_attn_split",
                                                                          "_lookahead_attn_merge")]
    assert fake.current is None
    assert isinstance(device_binding(torch.device("cpu")), contextlib.nullcontext)


class FakeGraphs:
    """torch.cuda's stream and graph API, recording the bound device at each call and the capture's options."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake, self.capture_options = fake, []
        outer = self

        class Stream:
            def __init__(self, device=None):
                outer.fake.record(f"stream({device})")

            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def replay(self):
                outer.fake.record("replay")

        self.Stream, self.CUDAGraph = Stream, CUDAGraph

    def current_stream(self, device=None):
        return self.Stream(device)

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    @contextlib.contextmanager
    def graph(self, graph, pool=None, capture_error_mode="global", **kwargs):
        self.fake.record("capture")
        self.capture_options.append(capture_error_mode)
        yield


@needs_interpreter
def test_runner_binds_its_device_for_streams_captures_replays_and_launches(tiny_checkpoint, monkeypatch):
    """With CUDA graphs faked: every stream, capture, replay and kernel launch of a step happens while the model's
    device is bound; captures are thread-local; `capture` prepares each given shape once, up front."""
    fake = FakeCuda()
    graphs = FakeGraphs(fake)
    for name in ("Stream", "CUDAGraph", "current_stream", "stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(graphs, name))
    monkeypatch.setattr(runner_module, "device_binding", fake.bind)
    monkeypatch.setattr(launcher, "device_binding", fake.bind)
    for name in ("_lookahead_attn_split", "_lookahead_attn_merge"):
        monkeypatch.setattr(launcher, name, RecordedLaunch(fake, name))
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), attn_backend="triton")
    runner = CachedRunner(model, 16, max_step_tokens=18, max_rows=2)
    runner.static = runner.cuda_graphs = True  # what a CUDA device gives
    shapes = [StepShape(8, 1, 8), StepShape(16, 1, 16, 8), StepShape(32, 2, 32, 8)]
    runner.capture(shapes)
    runner.capture(shapes)  # already captured: nothing happens
    assert [what for what, _ in fake.events].count("capture") == 3
    sequence = runner.sequence(64)
    sequence.prefill([1, 2, 3])  # a prompt chunk runs eagerly: no capture
    tree = StepPattern(1, 4, tree_end=(3, 2, 3, 4, 5, 6))
    sequence.step(list(range(9)), tree, [0, 3, 4, 5], topk=8)  # 9 tokens: the 16-token shape
    assert [what for what, _ in fake.events].count("capture") == 3 and fake.events[-1][0] == "replay"
    sequence.step(list(range(6)), StepPattern(2, 3, 1), [0, 4, 5], topk=8)  # a new shape: captured on first use
    assert [what for what, _ in fake.events].count("capture") == 4
    assert fake.events and all(device == model.device for _, device in fake.events), fake.events
    assert {what.split("(")[0] for what, _ in fake.events} >= {"stream", "capture", "replay", "_lookahead_attn_split"}
    assert graphs.capture_options == ["thread_local"] * 4


def test_step_logits_are_read_within_the_step(tiny_checkpoint, monkeypatch):
    """The contract that lets graphed steps hand out views into the graphs' pool: nobody reads a step's logits
    after the next step. Poisoning them at the start of each step (as a replay of any graph may) changes no token."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    kwargs = dict(max_new_tokens=24, eos_token_id=[], temperature=0.8, top_p=0.9, seed=1)
    cfg = LookaheadConfig(3, 4, 3)
    want = [model.generate([3, 17, 22, 3, 17], lookahead=cfg, **kwargs).tokens,
            [r.tokens for r in model.generate([[3, 17, 22], [5, 9, 5, 9]], lookahead=cfg, **kwargs)]]
    step, handed = runner_module.CachedRunner.step, []

    def poisoning_step(self, *args, **kw):
        for logits in handed:
            logits.fill_(float("nan"))
        handed.clear()
        outputs = step(self, *args, **kw)
        handed.extend(output.logits for output in outputs)
        return outputs

    monkeypatch.setattr(runner_module.CachedRunner, "step", poisoning_step)
    got = [model.generate([3, 17, 22, 3, 17], lookahead=cfg, **kwargs).tokens,
           [r.tokens for r in model.generate([[3, 17, 22], [5, 9, 5, 9]], lookahead=cfg, **kwargs)]]
    assert got == want


EIGHT_B = dict(heads_q=32, heads_kv=8, head_dim=128, dtype=torch.bfloat16, max_len=4096)
SUBSTEP = StepPattern(1, 2, tree_end=tuple(range(1, 64)))  # a 64-token lookahead-parallel sub-step


@pytest.mark.parametrize("name, pattern, table", [
    ("default-1-4-5", StepPattern(1, 4, tree_end=tuple(range(1, 16))), TilePlan(72, 128, 1, 16)),
    ("3-4-3", StepPattern(3, 4, 3), TilePlan(72, 128, 1, 16)),
    ("15-5-15", StepPattern(15, 5, 15), TilePlan(480, 128, 4, 4)),
    ("substep-64", SUBSTEP, TilePlan(256, 128, 2, 8)),
    ("plain", StepPattern(1, 2, 0), TilePlan(4, 16, 1, 16)),
])
def test_tile_table_reads_kv_once_where_it_fits(name, pattern, table):
    """On an 8B shape (Hq 32, Hkv 8, D 128, L 4096, 132 SMs): the step's rows (T x group) fill the row tiles, so the
    default step and a 64-token sub-step read each K/V block once or twice, not 3 and 16 times."""
    assert pattern.num_tokens == {"default-1-4-5": 18, "3-4-3": 18, "15-5-15": 120, "substep-64": 64}.get(name, 1)
    assert tile_plan(pattern, **EIGHT_B) == table
    assert table.kv_passes == -(-table.rows // table.rows_per_tile)


def test_a_short_step_or_a_lone_row_splits_the_prefix_more():
    """An 8B shape on 132 SMs, one plan for up to 8 rows of 120-token steps (a self-tuned engine's): each call's
    split count follows its own rows and tokens (issue 38), so a lone plain row fills about one wave."""
    plan = PagedAttentionPlan(heads_q=32, heads_kv=8, head_dim=128, dtype=torch.float16, device="cpu", max_rows=8,
                              max_row_tokens=120, max_len=4096)  # bf16's tiles are fp16's
    assert plan.num_splits == plan.splits(8, 960) == 1  # 8 rows x 4 query tiles x 8 KV heads: two waves already
    assert plan.splits(1, 8) == 16  # a lone plain row padded to 8 tokens: 8 KV heads x 17 = 136 programs
    assert plan.splits(1, 32) == 16  # a lone default step (T = 18, padded to 32): one query tile
    assert plan.splits(1, 120) == 4  # a lone 120-token step: 4 query tiles
