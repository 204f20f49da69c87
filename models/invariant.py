"""The batch-invariant mode's GEMMs (`Llama(batch_invariant=True)`): every linear computes each row alike, whatever
rows come with it, and in float32.

On the CPU: `lookahead.kernels.cpu_kernels`, the package's own kernel, compiled once per machine into the cache folder
(each output a fused multiply-add chain over K in order; bfloat16 weights read as 16 bits, and multiplied by the CPU's
bf16 dot products where it has them: `cpu_kernels.pairs`); a GGUF model's quantized linears (`models.quantized`) by
`lookahead.kernels.quant`, each row quantized on its own and multiplied with integer dot products. Where it cannot be
built, and on other devices: `lookahead.kernels.invariant_linear`, torch's GEMMs through row counts verified to compute
every row alike, in float32 from float32 copies of 16-bit weights (a 16-bit output hides most differences of reduction
order, so that check can only be trusted on float32 outputs). Either way a 16-bit model's GEMMs accumulate in float32
and round their outputs to its dtype, as a GPU's tensor cores do. Weight copies are made at first use, and again when a
weight changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lookahead.kernels import cpu_kernels, quant
from lookahead.kernels.row_plans import invariant_linear
from lookahead.paths import cache_root

from .attention import Paged
from .fusion import MergedLinears
from .quantized import QuantLinear


class InvariantOps:
    """`linear(module, x)`: the module's `F.linear`, batch-invariant, accumulated in float32; the norms and SiLU as the
    mode runs them (`norm`, `silu_mul`); and with the CPU kernels, a packed step's decoder layers all in one call
    (`decoder_layers`)."""

    whole_layers = True  # run a packed step's layers in one call where it applies (False: one by one, for tests)

    def __init__(self) -> None:
        # (ids, kind) -> (versions, addresses, copy): one copy per weight, or per group of weights run side by side
        self._copies: dict[tuple[tuple[int, ...], str], tuple[tuple, tuple, object]] = {}
        self._runs: dict[str, bool] = {}  # device type -> `runs_cpu_kernels`' answer (kept: every linear asks it)
        self._layers: dict[tuple[int, ...], list | None] = {}  # layers' ids -> [modules, stamp, weights]

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.side_by_side((module,), x)[0]

    def side_by_side(self, modules: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """Each module's output on the same input. With the CPU kernel, one GEMM over their weights side by side
        (each output column its own chain over K, so each output is bitwise what the module alone gives, in one call
        instead of several); torch's GEMMs choose their reduction by shape, so elsewhere each runs alone."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        quantized = [isinstance(m, QuantLinear) for m in modules]
        if any(quantized) and not all(quantized):
            # each alone, each by the mode's own path (a float linear's F.linear would not be batch-invariant)
            return [self.side_by_side((m,), x)[0] for m in modules]
        if all(quantized):  # a GGUF model's (`models.quantized`): their blobs side by side in one call
            outs = quant.gemm(rows, [m.weight for m in modules]).split([m.out_features for m in modules], dim=1)
        elif self.runs_cpu_kernels(x.device):  # rows in their dtype: bf16 dot products take bf16
            outs = [cpu_kernels.gemm(rows, self._packed(modules))]
            if len(modules) > 1:
                outs = outs[0].split([m.out_features for m in modules], dim=1)
        else:
            rows = rows.float().contiguous()
            outs = [invariant_linear(rows, self._copy((m.weight,), "float32", lambda ws: ws[0].float()))
                    for m in modules]
        return [(out if m.bias is None else out + m.bias.float()).to(x.dtype).reshape(*shape[:-1], out.shape[-1])
                for m, out in zip(modules, outs, strict=True)]

    def embed(self, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for `ids`: the module's own, or, for a weight tied to a head whose weight lives only
        in its packed copy (`keep_once`), that copy's rows (the same values)."""
        weight = module._parameters.get("weight")
        if weight is None or not weight.is_meta:
            return module(ids)
        return self.kept_copy(weight).rows(ids).to(weight.dtype)

    def kept_copy(self, weight: torch.Tensor) -> cpu_kernels.Packed:
        """The packed copy of `weight` alone (a released weight's values: `keep_once`); RuntimeError where none is
        kept (a weight packed side by side with others, or never packed)."""
        kept = self._copies.get(_copy_key((weight,), "packed"))
        if kept is None:
            raise RuntimeError("no packed copy of this weight alone is kept")
        return kept[2]

    def keep_once(self, model: nn.Module, layers, head: nn.Linear) -> int:
        """Pack every float linear of `layers` and the head for the CPU kernel now, the groups `side_by_side` and
        `decoder_layers` run (q/k/v, o, gate/up, down, the head), and release their parameters: each becomes a
        parameter on the meta device of the same shape and dtype (in every module of `model` that holds it: a tied
        embedding too, which then reads `embed`), so the packed copy is the weight's one copy in memory. Merged weights
        (`MergedLinears`) go with them. Quantized linears, which are their blocks already, are left. Returns the bytes
        released."""
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append((module, name))
        groups = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            groups += [(a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,)]
        released = 0
        for group in [*groups, (head,)]:
            if any(isinstance(m, QuantLinear) or m.weight.is_meta for m in group):
                continue
            packed, olds, news = self._packed(group), [m.weight for m in group], []
            for old in olds:
                new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
                for module, name in holders.get(id(old), ()):
                    module._parameters[name] = new
                news.append(new)
                released += old.numel() * old.element_size()
            del self._copies[_copy_key(olds, "packed")]
            self._copies[_copy_key(news, "packed")] = (*_stamp(news), packed)
        for layer in layers:  # the merged tensors whose rows the released parameters were
            for merged in (layer.self_attn, layer.mlp):
                weight = getattr(merged, "merged_weight", None)
                if isinstance(merged, MergedLinears) and weight is not None and not weight.is_meta and all(
                        getattr(merged, name).weight.is_meta for name in merged.MERGED):
                    merged.merged_weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        self._layers.clear()
        cpu_kernels.give_back_freed()
        return released

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The module's RMSNorm as the mode runs it: with the CPU kernels, `cpu_kernels.rms_norm` (what
        `decoder_layers` runs, so the layers one by one give its bits); elsewhere the module's own."""
        if self.runs_cpu_kernels(x.device):
            return cpu_kernels.rms_norm(x, module.weight, module.eps)
        return module(x)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up as the mode runs it: with the CPU kernels, `cpu_kernels.silu_mul` (what `decoder_layers`
        runs); elsewhere torch's."""
        if self.runs_cpu_kernels(gate.device):
            return cpu_kernels.silu_mul(gate, up)
        return F.silu(gate) * up

    def decoder_layers(self, layers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attend) -> torch.Tensor | None:
        """x after every decoder layer of `layers` in one call of the CPU kernels (`cpu_kernels.decoder_layers`: the
        ops of the layers' own forward, so the same bits, without Python between them), where it applies:
        `whole_layers`, a packed step whose attention is the CPU kernel's (`Paged.cpu_kernel_inputs`: the runner chose
        it where `runs_cpu_kernels` said so), LLaMA layers without biases or q/k norms. None elsewhere: the caller runs
        the layers one by one."""
        # any `Attend` may come here (a caller's own forward passes a plain function): only a paged step's holds the
        # pool and the key lists the one call takes
        inputs = attend.cpu_kernel_inputs() if isinstance(attend, Paged) else None
        if not self.whole_layers or inputs is None:
            return None
        weights = self._layer_weights(layers)
        if weights is None:
            return None
        attention, mlp = layers[0].self_attn, layers[0].mlp
        pool, write_slots, keys = inputs
        return cpu_kernels.decoder_layers(x, cos, sin, weights, pool.k, pool.v, write_slots, keys.queries, keys.slots,
                                       keys.counts, attention.heads, attention.kv_heads,
                                       mlp.gate_proj.out_features, layers[0].input_layernorm.eps)

    def _layer_weights(self, layers) -> list[torch.Tensor] | None:
        """Six tensors per layer for `cpu_kernels.decoder_layers` (norm weight, q/k/v packed, o packed, norm weight,
        gate/up packed, down packed), or None for layers with biases or q/k norms. Kept between steps and checked at
        each by the weights' identities, versions and addresses: gathering them through the modules' attributes
        costs a step about half a millisecond."""
        key = tuple(map(id, layers))
        if key not in self._layers:
            modules = []
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
                if a.qk_norm or any(linear.bias is not None for linear in linears):
                    self._layers[key] = None
                    return None
                modules += [layer.input_layernorm, *linears[:4], layer.post_attention_layernorm, *linears[4:]]
            self._layers[key] = [modules, None, None]
        kept = self._layers[key]
        if kept is None:
            return None
        modules, stamp, weights = kept
        params = [module._parameters["weight"] for module in modules]
        now = [(id(p), p._version, p.data_ptr()) for p in params]
        if now != stamp:
            weights = []
            for i in range(0, len(modules), 9):
                norm, q, k, v, o, post_norm, gate, up, down = modules[i : i + 9]
                groups = [self._side_by_side_weight(group) for group in ((q, k, v), (o,), (gate, up), (down,))]
                if any(group is None for group in groups):
                    self._layers[key] = None
                    return None
                weights += [[norm.weight], *groups[:2], [post_norm.weight], *groups[2:]]
            kept[1:] = now, weights
        return weights

    def _side_by_side_weight(self, modules: tuple[nn.Module, ...]) -> list[torch.Tensor] | None:
        """What `cpu_kernels.decoder_layers` takes for linears side by side: [their packed weight], or their quantized
        blobs; None for a mix of the two (the layers then run one by one)."""
        kinds = {isinstance(m, QuantLinear) for m in modules}
        if kinds == {True}:
            return [m.weight for m in modules]
        return None if len(kinds) > 1 else [self._packed(modules).blocks]

    def _packed(self, modules: tuple[nn.Linear, ...]) -> cpu_kernels.Packed:
        """The modules' weights side by side, packed for the CPU kernel (the copy `side_by_side` uses)."""
        return self._copy(tuple(m.weight for m in modules), "packed", lambda ws: cpu_kernels.pack(torch.cat(ws)))

    def runs_cpu_kernels(self, device: torch.device) -> bool:
        """`runs_cpu_kernels(device)`, its answer kept per device type (every linear asks it; finding the build
        folder again would cost each a few microseconds)."""
        runs = self._runs.get(device.type)
        if runs is None:
            runs = self._runs[device.type] = runs_cpu_kernels(device)
        return runs

    def _copy(self, params: tuple[torch.Tensor, ...], kind: str, make):
        if kind == "float32" and len(params) == 1 and params[0].dtype == torch.float32:
            return params[0]
        key, (versions, addresses) = _copy_key(params, kind), _stamp(params)
        kept = self._copies.get(key)
        if kept is None or kept[0] != versions or kept[1] != addresses:
            kept = self._copies[key] = (versions, addresses, make(params))
        return kept[2]


def _copy_key(params, kind: str) -> tuple[tuple[int, ...], str]:
    """Where `InvariantOps._copies` keeps a copy of `params` (one weight, or a group side by side)."""
    return tuple(map(id, params)), kind


def _stamp(params) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(versions, addresses) of `params`: a kept copy is stale once either changes."""
    return tuple(p._version for p in params), tuple(p.data_ptr() for p in params)


def runs_cpu_kernels(device: torch.device) -> bool:
    """Whether the package's CPU kernels (`lookahead.kernels.cpu_kernels`, GGUF's `quant` in the same build) run a
    model on `device`: a CPU, and the kernels built here. The one answer: the loaders (a GGUF file's quantized weights
    kept, the default dtype: `placement.default_dtype`), the mode's linears and norms (`InvariantOps`) and, with the
    mode, `Llama.uses_cpu_kernels` (the runner's attention, the cost key, the layers in one call) all ask it."""
    return device.type == "cpu" and cpu_kernels_built()


def cpu_kernels_built() -> bool:
    """Whether the package's CPU kernels are built here (building them into the cache folder's `kernels` on the first
    call: about a minute, once per machine)."""
    root = cache_root()
    return cpu_kernels.available(None if root is None else root / "kernels")
