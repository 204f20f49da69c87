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
from .quantized import QuantEmbedding, QuantLinear
from .rope import Angles


class InvariantOps:
    """`linear(module, x)`: the module's `F.linear`, batch-invariant, accumulated in float32; the norms and SiLU as the
    mode runs them (`norm`, `silu_mul`); and with the CPU kernels, a packed step from its ids to its logits in one call
    (`decoder_step`)."""

    whole_step = True  # run a packed step in one call where it applies (False: op by op, for tests)

    def __init__(self) -> None:
        # (ids, kind) -> (versions, addresses, copy): one copy per weight, or per group of weights run side by side
        self._copies: dict[tuple[tuple[int, ...], str], tuple[tuple, tuple, object]] = {}
        self._runs: dict[str, bool] = {}  # device type -> `runs_cpu_kernels`' answer (kept: every linear asks it)
        # (decoder's id, head's id) -> [modules, stamps, (weights, embedding table)], or None where it cannot run
        self._steps: dict[tuple[int, int], list | None] = {}

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
        `decoder_step` runs (q/k/v, o, gate/up, down, the head), and release their parameters: each becomes a
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
        self._steps.clear()
        cpu_kernels.give_back_freed()
        return released

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The module's RMSNorm as the mode runs it: with the CPU kernels, `cpu_kernels.rms_norm` (what
        `decoder_step` runs, so the layers one by one give its bits); elsewhere the module's own."""
        if self.runs_cpu_kernels(x.device):
            return cpu_kernels.rms_norm(x, module.weight, module.eps)
        return module(x)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up as the mode runs it: with the CPU kernels, `cpu_kernels.silu_mul` (what `decoder_step`
        runs); elsewhere torch's."""
        if self.runs_cpu_kernels(gate.device):
            return cpu_kernels.silu_mul(gate, up)
        return F.silu(gate) * up

    def decoder_step(self, decoder: nn.Module, head: nn.Linear, input_ids: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, attend, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The step's logits [1, R, vocab] at `rows` in one call of the CPU kernels (`cpu_kernels.decoder_step`: the
        embedding, every decoder layer, the final norm and the head; the ops of the model's own forward as the mode runs
        them, so the same bits, without Python between them), where it applies: `whole_step`, a packed step whose
        attention is the CPU kernel's (`Paged.cpu_kernel_inputs`: the runner chose it where `runs_cpu_kernels` said
        so), a LLaMA model without biases or q/k norms. None elsewhere: the caller runs the step op by op.
        decoder: the model's `LlamaModel` (embedding, layers, final norm); input_ids [1, T]; positions, rows: as
        `Llama.forward` takes them (None: every token)."""
        # any `Attend` may come here (a caller's own forward passes a plain function): only a paged step's holds the
        # pool and the key lists the one call takes
        inputs = attend.cpu_kernel_inputs() if isinstance(attend, Paged) else None
        if not self.whole_step or inputs is None or input_ids.shape[0] != 1:
            return None
        kept = self._step_weights(decoder, head)
        if kept is None:
            return None
        weights, table, dtype = kept
        cos, sin = Angles.at(inv_freq, positions.reshape(-1), dtype)  # ([T], or [1, T]: one row)
        ids = input_ids[0]
        rows = torch.arange(ids.shape[0]) if rows is None else rows.reshape(-1)
        attention, mlp = decoder.layers[0].self_attn, decoder.layers[0].mlp
        pool, write_slots, keys = inputs
        return cpu_kernels.decoder_step(ids, table, cos, sin, weights, pool.k, pool.v, write_slots, keys.queries,
                                        keys.slots, keys.counts, rows, attention.heads, attention.kv_heads,
                                        mlp.gate_proj.out_features, head.out_features, decoder.norm.eps)

    def _step_weights(self, decoder: nn.Module, head: nn.Linear) -> tuple[list, torch.Tensor, torch.dtype] | None:
        """What `cpu_kernels.decoder_step` takes of the model: its weights (six lists per layer: norm weight, q/k/v
        packed, o packed, norm weight, gate/up packed, down packed; then the final norm's weight and the head), the
        embedding's table and the activations' dtype; None for what it cannot run (layers with biases or q/k norms,
        norms of differing eps, float and quantized linears side by side). Kept between steps and checked at each by
        the weights' stamps (`cpu_kernels.stamps`, one call: gathering them through the modules' attributes cost a
        step about half a millisecond)."""
        key = (id(decoder), id(head))
        if key not in self._steps:
            modules, norms = [], [decoder.norm]
            for layer in decoder.layers:
                a, m = layer.self_attn, layer.mlp
                linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
                if a.qk_norm or any(linear.bias is not None for linear in linears):
                    self._steps[key] = None
                    return None
                modules += [layer.input_layernorm, *linears[:4], layer.post_attention_layernorm, *linears[4:]]
                norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if head.bias is not None or len({norm.eps for norm in norms}) > 1:
                self._steps[key] = None
                return None
            self._steps[key] = [[*modules, decoder.norm, head, decoder.embed_tokens], None, None]
        kept = self._steps[key]
        if kept is None:
            return None
        modules, stamps, step = kept
        now = cpu_kernels.stamps([module._parameters["weight"] for module in modules])
        if stamps is None or not torch.equal(now, stamps):
            weights = []
            for i in range(0, len(modules) - 3, 9):
                norm, q, k, v, o, post_norm, gate, up, down = modules[i : i + 9]
                weights += [[norm.weight], (q, k, v), (o,), [post_norm.weight], (gate, up), (down,)]
            weights += [[decoder.norm.weight], (head,)]
            weights = [w if isinstance(w, list) else self._side_by_side_weight(w) for w in weights]
            table = self._embedding_table(decoder.embed_tokens)
            if any(w is None for w in weights) or table is None:
                self._steps[key] = None
                return None
            kept[1:] = now, (weights, *table)
        return kept[2]

    def _embedding_table(self, module: nn.Module) -> tuple[torch.Tensor, torch.dtype] | None:
        """The table `cpu_kernels.decoder_step` reads the embedding's rows from, and their dtype (what `embed` gives):
        its weight, or a tied weight's packed copy (`keep_once`), or its quantized blob; None for another module."""
        weight = module._parameters.get("weight")
        if isinstance(module, QuantEmbedding):
            return weight, module.dtype_carrier.dtype
        if type(module) is not nn.Embedding or weight is None:
            return None
        if weight.is_meta:
            return self.kept_copy(weight).blocks, weight.dtype
        return weight.detach().contiguous(), weight.dtype

    def _side_by_side_weight(self, modules: tuple[nn.Module, ...]) -> list[torch.Tensor] | None:
        """What `cpu_kernels.decoder_step` takes for linears side by side: [their packed weight], or their quantized
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
