"""The blocks of a LLaMA layer, with Hugging Face parameter names: RMSNorm, attention, MLP, the decoder layer and
the backbone (`model.*` of a checkpoint). Each attention and MLP also has a merged forward (`fusion` other than
"none": one GEMM for q/k/v and one for gate/up, the small ops by `models.fusion`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attend
from .config import LlamaConfig
from .fusion import MergedLinears, TorchOps, TritonOps
from .rope import Angles, apply_rotary_qk

Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]  # how a block runs one of its linears on an input


def _call(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The linear as torch runs it (the batch-invariant mode passes `models.invariant.InvariantOps` instead)."""
    return module(x)


def _side_by_side(linear: Linear, modules: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The modules' outputs on the same input, in one call where the hook runs several at once (the batch-invariant
    mode's `side_by_side`: the same bits as one at a time)."""
    many = getattr(linear, "side_by_side", None)
    return many(modules, x) if many is not None else [linear(m, x) for m in modules]


def _norm(linear: Linear, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm as the hook runs it, where it has one (the batch-invariant mode's `norm`); else the module's own."""
    norm = getattr(linear, "norm", None)
    return norm(module, x) if norm is not None else module(x)


def _silu_mul(linear: Linear, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up as the hook runs it, where it has one (the batch-invariant mode's `silu_mul`); else torch's."""
    silu_mul = getattr(linear, "silu_mul", None)
    return silu_mul(gate, up) if silu_mul is not None else F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, as transformers does; one fused op instead of five
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(MergedLinears):
    MERGED = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: each head's q and k normalised over head_dim, before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.merge()

    def forward(self, x: torch.Tensor, angles: Angles, layer: int, attend: Attend,
                linear: Linear = _call) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = _side_by_side(linear, (self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = _norm(linear, self.q_norm, q), _norm(linear, self.k_norm, k)
        q, k = apply_rotary_qk(q, k, *angles)
        # [B, Hq, T, D]; the kernel's is a view of [B, T, Hq, D], so the reshape below copies nothing
        out = attend(layer, q.transpose(1, 2), k.transpose(1, 2), v)
        return linear(self.o_proj, out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def merged_forward(self, x: torch.Tensor, ops: TritonOps | TorchOps, layer: int, attend: Attend) -> torch.Tensor:
        """q, k and v from one GEMM; RoPE by `ops` on views of its output (in place with the Triton kernel)."""
        b, t, _ = x.shape
        qkv = F.linear(x, self.merged_weight, self.merged_bias).view(b, t, -1, self.head_dim)
        q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k)
        out = attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(MergedLinears):
    MERGED = ("gate_proj", "up_proj")

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.merge()

    def forward(self, x: torch.Tensor, linear: Linear = _call) -> torch.Tensor:
        gate, up = _side_by_side(linear, (self.gate_proj, self.up_proj), x)
        return linear(self.down_proj, _silu_mul(linear, gate, up))

    def merged_forward(self, x: torch.Tensor, ops: TritonOps | TorchOps) -> torch.Tensor:
        """Gate and up from one GEMM, then SiLU(gate) * up by `ops`."""
        return self.down_proj(ops.silu_mul(F.linear(x, self.merged_weight, self.merged_bias)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, angles: Angles, layer: int, attend: Attend,
                linear: Linear = _call) -> torch.Tensor:
        x = x + self.self_attn(_norm(linear, self.input_layernorm, x), angles, layer, attend, linear)
        return x + self.mlp(_norm(linear, self.post_attention_layernorm, x), linear)

    def merged_forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops: TritonOps | TorchOps, layer: int,
                       attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): each residual add rides with the
        norm after it, so the next layer (or the final norm) adds the MLP output."""
        h, residual = ops.norm(x, residual, self.input_layernorm)
        x = self.self_attn.merged_forward(h, ops, layer, attend)
        h, residual = ops.norm(x, residual, self.post_attention_layernorm)
        return self.mlp.merged_forward(h, ops), residual


class Backbone(nn.Module):
    """`model.*` of a Hugging Face LLaMA checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=_embedding(cfg))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _embedding(cfg: LlamaConfig) -> torch.Tensor:
    """The embedding's weight, initialised as `nn.Embedding` does except on the meta device: there `normal_` goes
    through torch._refs, whose first call imports torch._dynamo (~75 MB resident, for a checkpoint's loading that then
    overwrites the weight; measured as 0.6x of a 120 MB checkpoint's size in a load's peak)."""
    weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return weight

