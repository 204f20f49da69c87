"""A CUDA-graph emulator for the CPU: record a region as a capture would, fail on what capture forbids, replay it.

`GraphEmulator` runs a region under a `TorchDispatchMode` that records every aten op (and every Triton launch, through
`triton_launches`) with the very tensors it touched, as a captured graph holds fixed addresses, and raises
`CaptureViolation` on what a CUDA graph cannot hold:
- a host sync: an op tagged `data_dependent_output` (`.item()`, `int(t)`, `torch.equal`, ...), or `tolist`/`numpy`;
- a data-dependent output shape: an op tagged `dynamic_output_shape` (`nonzero`, boolean indexing, ...);
- random numbers: an op tagged `nondeterministic_seeded` (a replay would repeat the captured draw);
- a tensor built from host data inside the region (`torch.tensor(...)`: `lift_fresh`), whose values would be baked;
- a tensor read inside the region that was neither made inside it nor held by the long-lived state the caller names
  (`static`): a per-step temporary whose address the replay would read after it was freed or reused;
- (`check_escapes`) a tensor made inside the region and kept by long-lived state other than the region's outputs:
  its memory belongs to the graph pool, which the runner's other graphs reuse.
`replay()` then runs the recording again, each op on the recorded tensors (views skipped: they alias; functional ops
copy their result into the recorded output, as a graph writes its fixed buffers), so new inputs written into the
static buffers flow through it as through a replayed graph; Python values the region read are baked as in a graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

_HOST_DATA = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
             torch.ops.aten._index_put_impl_.default}


class CaptureViolation(AssertionError):
    """Something in the region that a CUDA graph capture forbids or would replay wrongly."""


def reachable_tensors(*roots, depth: int = 5) -> list[torch.Tensor]:
    """Tensors held by `roots` (modules' parameters and buffers, objects' attributes, dicts, lists, tuples)."""
    found, seen = [], set()

    def walk(obj, level):
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            found.extend(obj.parameters())
            found.extend(obj.buffers())
            for key, value in vars(obj).items():
                if key not in ("_parameters", "_buffers", "_modules"):
                    walk(value, level + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, level + 1)
        elif isinstance(obj, list | tuple):
            for value in obj:
                walk(value, level + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for value in vars(obj).values():
                walk(value, level + 1)

    for root in roots:
        walk(root, 0)
    return found


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class GraphEmulator(TorchDispatchMode):
    """Record a region (`with GraphEmulator(static) as graph: ...`), then `graph.replay()`."""

    _active: GraphEmulator | None = None

    def __init__(self, static: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.static = {_storage(t) for t in static}
        self.born: set[int] = set()
        self.entries: list[tuple] = []
        self.ops: list[str] = []  # every op and launch, in order (op budgets count these)
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        GraphEmulator._active = self
        for name in ("tolist", "numpy"):
            self._patches.enter_context(_forbid(torch.Tensor, name))
        return super().__enter__()

    def __exit__(self, *exc):
        GraphEmulator._active = None
        self._patches.close()
        return super().__exit__(*exc)

    def _check_inputs(self, what: str, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in self.born | self.static:
                raise CaptureViolation(f"{what} reads a tensor {tuple(t.shape)} {t.dtype} made outside the region and "
                                       "held by nothing long-lived: a replay would read its address after it is gone")

    def _born(self, tensors, inputs) -> None:
        """Note the new memory among an op's outputs (not what it wrote in place or viewed)."""
        known = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in known:
                self.born.add(_storage(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            raise CaptureViolation(f"{name}: a host sync (the value is read on the host) inside the region")
        if torch.Tag.nondeterministic_seeded in tags and _draws(func, args, kwargs):
            raise CaptureViolation(f"{name}: random numbers inside the region (a replay repeats the captured draw)")
        if func in _HOST_DATA:
            raise CaptureViolation(f"{name}: a tensor built from host data inside the region (its values are baked)")
        flat_in = tree_flatten((args, kwargs))[0]
        if func in _INDEXING:
            dynamic = any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in flat_in[1:])
        else:
            dynamic = torch.Tag.dynamic_output_shape in tags
        if dynamic:
            raise CaptureViolation(f"{name}: a data-dependent output shape inside the region")
        self._check_inputs(name, flat_in)
        out = func(*args, **kwargs)
        self._born(tree_flatten(out)[0], flat_in)
        self.entries.append(("aten", func, args, kwargs, out))
        self.ops.append(name)
        return out

    def launch(self, kernel, grid, args, kwargs) -> None:
        """A Triton launch inside the region: checked like an op, recorded, run with the recording paused."""
        name = f"triton.{getattr(kernel, '__name__', None) or kernel.fn.__name__}"
        self._check_inputs(name, args)
        self.entries.append(("triton", kernel, grid, args, kwargs))
        self.ops.append(name)
        with _disable_current_modes():
            kernel[grid](*args, **kwargs)

    def check_escapes(self, *roots, outputs=()) -> None:
        """Fail if long-lived state (`roots`, walked as `reachable_tensors` does) holds a tensor made inside the region,
        other than the region's `outputs` (what the runner reads after each replay)."""
        allowed = {_storage(t) for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)}
        for t in reachable_tensors(*roots):
            if t.numel() and _storage(t) in self.born - allowed:
                raise CaptureViolation(f"a tensor {tuple(t.shape)} {t.dtype} made inside the region is kept after it: "
                                       "its memory is the graph pool's, which other graphs of the runner reuse")

    def replay(self) -> None:
        """Run the recording again on its own tensors, as `CUDAGraph.replay` would."""
        for entry in self.entries:
            if entry[0] == "triton":
                _, kernel, grid, args, kwargs = entry
                kernel[grid](*args, **kwargs)
                continue
            _, func, args, kwargs, out = entry
            if func._schema.is_mutable:
                func(*args, **kwargs)  # writes into its (recorded) arguments
                continue
            if aliases(args, kwargs, out):
                continue  # a view of its input: it sees the new data already
            result = func(*args, **kwargs)
            for recorded, new in zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=True):
                if isinstance(recorded, torch.Tensor):
                    recorded.copy_(new)


def aliases(args, kwargs, out) -> bool:
    """Whether every tensor an op returned shares memory with one of its inputs (a view, or an alias such as a `to`
    of the same dtype; a `to` that casts is marked as a view op but writes new memory)."""
    inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(outputs) and all(_storage(t) in inputs for t in outputs)


def _draws(func, args, kwargs) -> bool:
    """Whether a seeded op draws random numbers here: attention ops are tagged for their dropout, off at p = 0."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = args[i] if i < len(args) else kwargs.get("dropout_p", func._schema.arguments[i].default_value)
    return p != 0


@contextlib.contextmanager
def _forbid(cls, name: str):
    original = getattr(cls, name)

    def forbidden(self, *args, **kwargs):
        raise CaptureViolation(f"Tensor.{name}: a host sync inside the region")

    setattr(cls, name, forbidden)
    try:
        yield
    finally:
        setattr(cls, name, original)


class _RecordedKernel:
    """Stands in for a kernel global of `lookahead.kernels.triton_attention`: inside an emulated region a launch is
    recorded (and run); outside, it just runs."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if GraphEmulator._active is None:
                return self.kernel[grid](*args, **kwargs)
            return GraphEmulator._active.launch(self.kernel, grid, args, kwargs)

        return launch


# each launcher module and its kernel globals (looked up at each launch)
KERNELS = {"triton_attention": ("_lookahead_attn_split", "_lookahead_attn_merge"),
           "fused": ("_add_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel")}


def triton_launches(monkeypatch) -> None:
    """Route the attention and fused kernels' launches through the emulator."""
    import importlib

    for module, names in KERNELS.items():
        launcher = importlib.import_module(f"lookahead.kernels.{module}")
        for name in names:
            monkeypatch.setattr(launcher, name, _RecordedKernel(getattr(launcher, name)))
