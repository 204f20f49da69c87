"""Batch-invariant GEMMs from the BLAS the device already has: each row's result independent of the other rows.

A GEMM library picks its kernel from the problem's shape: on a CPU, MKL computes the last one to three rows of an M
not divisible by four with an edge kernel, and oneDNN's bf16 path splits the rows among threads differently past a
size, so the same row gets different bits in a step of one token than in a step of eighteen. Every call with the same
shapes runs the same code, though, and every row of a call of a fixed size runs the same microkernel. So a GEMM is
made invariant by calling the library only with row counts that compute every row alike: a `RowPlan` pads the rows up
to a multiple of `multiple` and cuts them into calls of at most `limit` rows.

Which plan holds is a property of the library, the CPU, the thread count and the shape, not of the data: `plan_for`
finds it at first use by running the candidate plans on random rows and keeping the first (cheapest) under which
every row of every call size up to its limit equals the same row computed alone (`ROW_PLANS`, the one-row plan last,
which holds by construction). The reduction over K stays the library's own, in its one order per shape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowPlan:
    """Rows padded up to a multiple of `multiple`, at most `limit` rows per call."""

    multiple: int
    limit: int

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn over x [..., M, K] (rows on dim -2), called only with this plan's row counts; [..., M, N]."""
        m = x.shape[-2]
        outs = []
        for start in range(0, max(m, 1), self.limit):
            chunk = x[..., start : start + self.limit, :]
            rows = chunk.shape[-2]
            pad = -rows % self.multiple
            if pad or not _aligned(chunk):  # a fresh buffer: libraries may take other paths for unaligned rows
                chunk = F.pad(chunk, (0, 0, 0, pad))
            out = fn(chunk)
            outs.append(out[..., :rows, :] if pad else out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


# cheapest first: no padding (a one-token step pays nothing), then fewer calls; RowPlan(1, 1) always holds
ROW_PLANS = (RowPlan(1, 32), RowPlan(1, 16), RowPlan(4, 32), RowPlan(4, 16), RowPlan(1, 8), RowPlan(4, 8),
             RowPlan(8, 8), RowPlan(4, 4), RowPlan(1, 1))
# for small operands (attention's per-block GEMMs, checked in milliseconds): first try calls of up to 256 rows
WIDE_PLANS = (RowPlan(1, 256), RowPlan(4, 256), *ROW_PLANS)
_plans: dict[tuple, RowPlan] = {}
_lock = threading.Lock()


def _aligned(x: torch.Tensor) -> bool:
    return x.is_contiguous() and x.data_ptr() % 64 == 0


def plan_for(key: tuple, probe: Callable[[], Callable[[torch.Tensor], torch.Tensor]], rows: torch.Tensor,
             plans: tuple[RowPlan, ...] = ROW_PLANS) -> RowPlan:
    """The cheapest plan under which `probe()` (a function of rows [..., M, k] -> [..., M, N]) computes every row
    alike, for rows like `rows` (their k, dtype and device), found once per `key` (with the dtype, device and thread
    count: the library's split among threads may change with it) and remembered."""
    k, dtype, device = rows.shape[-1], rows.dtype, rows.device
    full_key = (*key, dtype, str(device), torch.get_num_threads())
    plan = _plans.get(full_key)
    if plan is None:
        with _lock:
            plan = _plans.get(full_key)
            if plan is None:
                plan = _plans[full_key] = _find_plan(probe(), k, dtype, device, plans)
    return plan


def _find_plan(fn: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype, device: torch.device,
               plans: tuple[RowPlan, ...]) -> RowPlan:
    rows = max(plan.limit for plan in plans)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, k, generator=generator).to(device=device, dtype=dtype)
    for plan in plans:
        alone = [plan.apply(fn, x[i : i + 1]) for i in range(plan.limit)]
        if all(torch.equal(plan.apply(fn, x[:m]), torch.cat(alone[:m], dim=-2)) for m in range(2, plan.limit + 1)):
            return plan
    return RowPlan(1, 1)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is bitwise the same whatever rows come with it: x [..., K] ->
    [..., N]. The bias is added after the GEMM (an add per element, the same for every row)."""
    shape = x.shape

    def gemm(chunk: torch.Tensor) -> torch.Tensor:
        return F.linear(chunk, weight)

    plan = plan_for(("linear", tuple(weight.shape), weight.stride()), lambda: gemm, x)
    out = plan.apply(gemm, x.reshape(-1, shape[-1]))
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, key: str, plans: tuple[RowPlan, ...] = WIDE_PLANS
                     ) -> torch.Tensor:
    """`torch.matmul(a, b)` (a [..., M, K], b [..., K, N], batch dims broadcasting) whose every row of every batch
    item is bitwise the same whatever rows and items come with it. `key` names b's layout (every call with one key
    passes b with the same strides' order: transposed or not), which the plan is found for; `plans`: the candidates,
    cheapest first (the default tries calls of up to 256 rows: for small b, whose check costs little)."""

    def probe() -> Callable[[torch.Tensor], torch.Tensor]:  # b's layout over two batch items of random values
        generator = torch.Generator(device="cpu").manual_seed(1)
        other = torch.randn(2, *b.shape[-2:], generator=generator).to(device=b.device, dtype=b.dtype)
        if b.stride(-2) == 1 and b.shape[-2] > 1:  # b is a transposed view: so is the probe's
            other = other.transpose(-1, -2).contiguous().transpose(-1, -2)
        return lambda chunk: torch.matmul(chunk, other)

    plan = plan_for(("matmul", key, tuple(b.shape[-2:]), plans), probe, a, plans)
    return plan.apply(lambda chunk: torch.matmul(chunk, b), a)
