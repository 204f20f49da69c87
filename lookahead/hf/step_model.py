"""`HFStepModel`: a transformers causal LM and its `DynamicCache` as the loop's `StepModel`, through the two hooks
transformers supports: an attention function registered with `AttentionInterface` (it receives q, k, v after RoPE
and after the cache update; the step's pattern reaches it as a forward keyword argument), selected only for the
duration of a step and restored after, so the model is left as it was. transformers is imported on first use.

The selection is the model config's `_attn_implementation`, which every caller of the model reads. So that no other
caller sees it (a plain `generate` in another thread, another lookahead generation whose steps overlap this one's),
the name selected during a step is `lookahead:<own>` (`<own>` the model's own implementation), registered with the
attention and with the mask interfaces: without the step's keyword argument it is the model's own attention and
mask, unchanged; and the switch is counted per config, so the last step to end restores the model's own.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lookahead.backends import choose_backend
from lookahead.kernels import StepAttentionPlan, StepPattern, commit_accepted, interpreting, masked_attention
from lookahead.loop import StepOutput
from lookahead.loop.sampling import SampleRequest

MIN_TRANSFORMERS = "5.0"  # the lowest tested (.ci/transformers-lowest); setup.py requires the same
ATTENTION_NAME = "lookahead"
# attention with q/k/v projections, RoPE by position_ids and the generic attention dispatch
# each held to transformers' own greedy output by tests/test_hf.py (architectures whose attention transformers runs
# through its AttentionInterface with standard RoPE, and no softcapping, parallel residual or partial rotary)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2",
                         "granite", "cohere")
# RoPE that does not depend on how many tokens one forward pass holds ("dynamic", "longrope" do)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_STEP_KWARG = "lookahead_step"
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a step's 4-D placeholder mask (the step attention ignores it)


def require_transformers() -> Any:
    """transformers, checked for the hooks this module uses; registers the step attention once."""
    try:
        import transformers
    except ImportError as missing:
        raise ImportError(f"lookahead.hf needs transformers >= {MIN_TRANSFORMERS}: pip install "
                          f"'transformers>={MIN_TRANSFORMERS}' ({missing})") from None
    from transformers import cache_utils, modeling_utils
    from transformers.generation import utils as generation_utils

    mixin = getattr(generation_utils, "GenerationMixin", None)
    missing = [name for name, ok in (
        ("AttentionInterface", hasattr(modeling_utils, "AttentionInterface")),
        ("cache_utils.DynamicLayer", hasattr(cache_utils, "DynamicLayer")),
        ("generate(custom_generate=<callable>)", mixin is not None
         and "custom_generate" in inspect.signature(mixin.generate).parameters
         and hasattr(mixin, "_extract_generation_mode_kwargs")),
    ) if not ok]
    if missing:
        raise ImportError(f"lookahead.hf needs transformers >= {MIN_TRANSFORMERS}; found transformers "
                          f"{transformers.__version__}, which lacks {', '.join(missing)}")
    interface = modeling_utils.AttentionInterface
    if interface().get(ATTENTION_NAME) is not _step_attention:
        interface.register(ATTENTION_NAME, _step_attention)
    return transformers


def max_positions(model) -> int:
    """The positions the model was built for (RoPE tables, position embeddings): a generation must stay inside."""
    return getattr(model.config, "max_position_embeddings", None) or 2**62


def cache_keyword(model) -> str:
    """The name the model's forward takes its cache by: `cache` since transformers 5.24, `past_key_values` before (5.24
    still takes the old name, with a FutureWarning, until 5.40). generate's model_kwargs and its output name the cache
    the same way, so read from the forward's signature this one answer serves all three."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _drop_last(cache, count: int) -> None:
    """Remove the last `count` positions of a cache or cache layer. `crop(-count)` means that in every transformers
    this adapter supports, but `crop(0)` does not: older releases (5.0 among them) read a count >= 0 as the length to
    keep, so crop(0) emptied the cache, where newer ones remove nothing."""
    if count > 0:
        cache.crop(-count)


def _register_step_name(own: str | None) -> str:
    """The implementation name a step selects on a model whose own is `own`, registered on first use: the step
    attention with the step's keyword argument, the model's own attention and mask without it."""
    from transformers import masking_utils, modeling_utils

    name = f"{ATTENTION_NAME}:{own}"
    if name not in modeling_utils.ALL_ATTENTION_FUNCTIONS:
        masking_utils.AttentionMaskInterface.register(name, _own_mask(own))
        modeling_utils.AttentionInterface.register(name, _step_or_own_attention(own))
    return name


@dataclass
class _Step:
    """What every layer's attention needs for one step, prepared once for all layers: the pattern, L, and either the
    dense mask (torch) or, for the kernel, L and the tree on the device and one launch plan per layer shape (so
    the per-layer call copies nothing to the device and checks nothing again)."""

    pattern: StepPattern
    prefix_len: int
    mask: torch.Tensor | None  # [T, L + T] bool for the torch backend; None for the kernel
    lengths: torch.Tensor | None = None  # [1] int64 on the device (kernel)
    tree_end: torch.Tensor | None = None  # [V] int64 on the device (kernel, tree form)
    plans: dict = field(default_factory=dict)  # (Hq, Hkv, D, dtype, scale) -> StepAttentionPlan

    def kernel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
        shape = (query.shape[1], key.shape[1], query.shape[3], query.dtype, scaling)
        plan = self.plans.get(shape)
        if plan is None:
            plan = self.plans[shape] = StepAttentionPlan(
                self.pattern, batch=query.shape[0], heads_q=shape[0], heads_kv=shape[1], head_dim=shape[2],
                dtype=query.dtype, device=query.device, max_len=self.prefix_len, sm_scale=scaling)
        return plan(query, key, value, self.lengths, self.tree_end)


def _step_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention: q [B, Hq, T, D] after RoPE, k/v [B, Hkv, L + T, D] after the cache update."""
    step: _Step | None = kwargs.get(_STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside lookahead.hf steps")
    if step.mask is None:
        out = step.kernel(query, key, value, scaling)
    else:
        out = masked_attention(query, key, value, step.prefix_len, step.mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _step_or_own_attention(own: str | None) -> Callable:
    """The attention of `lookahead:<own>`: a step's own (its keyword argument present), else the model's own."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if _STEP_KWARG in kwargs:
            return _step_attention(module, query, key, value, attention_mask, **kwargs)
        return _own_attention(module, own)(module, query, key, value, attention_mask, **kwargs)

    return attention


def _own_attention(module, own: str | None) -> Callable:
    """What the module's forward picks for `own` (eager is each modeling file's own function, not registered)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # the forward's own pick since 5.1, which checks the name
        function = ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)
    else:  # what 5.0's forward does itself
        function = eager if own in (None, "eager") else ALL_ATTENTION_FUNCTIONS[own]
    if function is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to run as its own attention")
    return function


def _own_mask(own: str | None) -> Callable:
    """The mask function of `lookahead:<own>`: the model's own, or none where its implementation takes no mask
    (what transformers does for an implementation with no mask function registered). A step passes its own 4-D
    placeholder mask, which transformers hands on as it is, so no mask is built for a step."""

    def mask(*args, **kwargs):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        function = ALL_MASK_ATTENTION_FUNCTIONS.get("eager" if own is None else own)
        return None if function is None else function(*args, **kwargs)

    return mask


_SWITCH_LOCK = threading.Lock()
_SWITCHED: dict[int, tuple[int, str | None]] = {}  # id(config) -> (steps under way, the model's own implementation)


@contextlib.contextmanager
def _step_implementation(model) -> Iterator[None]:
    """Select `lookahead:<own>` for the calls inside; the last step under way on the model restores its own (also on
    error). Counted, so overlapping steps on one model (two threads) neither take `lookahead:...` for the model's own
    nor restore it while another step is still running."""
    config = model.config
    with _SWITCH_LOCK:
        count, own = _SWITCHED.get(id(config), (0, config._attn_implementation))
        if count == 0:
            config._attn_implementation = _register_step_name(own)
        _SWITCHED[id(config)] = (count + 1, own)
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            count, own = _SWITCHED.pop(id(config))
            if count > 1:
                _SWITCHED[id(config)] = (count - 1, own)
            else:
                config._attn_implementation = own


def check_model(model) -> None:
    """Refuse, naming it, a model this adapter cannot drive exactly."""
    transformers = require_transformers()
    if (not isinstance(model, transformers.PreTrainedModel) or not model.can_generate()
            or model.config.is_encoder_decoder or model.get_output_embeddings() is None):
        raise TypeError(f"hf_model must be a transformers decoder-only causal LM (e.g. LlamaForCausalLM), "
                        f"got {type(model).__name__}")
    config = model.config
    on_meta = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if on_meta:  # NotImplementedError: Cannot copy out of meta tensor, deep inside the first forward
        raise ValueError(f"hf_model holds no weights: {len(on_meta)} of its tensors are on the meta device (e.g. "
                         f"{on_meta[0]!r}), as a model built under init_empty_weights or device_map='meta' is; load "
                         "its weights (from_pretrained with a real device, or load_state_dict(..., assign=True))")
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"hf_model architecture {config.model_type!r} ({type(model).__name__}) is not supported; "
                         f"lookahead.hf drives the attention of {', '.join(SUPPORTED_MODEL_TYPES)}")
    window = getattr(config, "sliding_window", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or window is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(f"hf_model uses sliding-window attention (sliding_window={window}, layer_types "
                         f"{sorted(layer_types)}), which lookahead.hf does not drive")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # flat, or one dict per layer type
    for params in ropes:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(f"hf_model's RoPE type {kind!r} depends on the forward pass's length, so a lookahead "
                             f"step would not match plain decoding; supported: {', '.join(STATIC_ROPE_TYPES)}")


class HFStepModel:
    """A transformers causal LM and its `DynamicCache` as a `StepModel` (batch 1).

    prefill runs the prompt under the model's own attention; a step feeds its T tokens at positions
    L + pattern.relative_positions through the registered step attention (the Triton kernel on CUDA,
    the SDPA reference with the pattern's mask elsewhere); commit moves the accepted entries to
    L, L+1, ... in every layer and crops the rest, with no recomputation.

    attn_backend: "auto" (triton on CUDA, torch elsewhere), "torch" or "triton".
    """

    def __init__(self, model, cache=None, attn_backend: str = "auto") -> None:
        transformers = require_transformers()
        check_model(model)
        self.model, self.device = model, model.device
        self.kernel = choose_backend(attn_backend, self.device.type, interpreting()) == "triton"
        cache_utils = transformers.cache_utils
        if cache is None:
            cache = cache_utils.DynamicCache(config=model.config)
        offloading = getattr(cache, "offloading", False)
        if type(cache) is not cache_utils.DynamicCache or offloading:
            kind = type(cache).__name__ + (" (offloading)" if offloading else "")
            raise ValueError(f"lookahead.hf needs a DynamicCache without offloading; got a {kind} "
                             "(cache_implementation other than 'dynamic' is not supported)")
        layer_types = {type(layer).__name__ for layer in cache.layers}
        if (cache.layers and layer_types != {"DynamicLayer"}) or cache.layer_class_to_replicate not in (
                None, cache_utils.DynamicLayer):
            raise ValueError(f"lookahead.hf needs a DynamicCache of full-attention layers, got {sorted(layer_types)}")
        if cache.get_seq_length() > 0:
            raise ValueError(f"the cache already holds {cache.get_seq_length()} positions; start from an empty one")
        self.cache = cache
        self.cache_keyword = cache_keyword(model)
        self.length = 0  # L: committed positions

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = torch.arange(self.length, self.length + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **{self.cache_keyword: self.cache})
        self.length += len(tokens)
        return out.logits[0, -1]

    @torch.no_grad()
    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0,
             sample: SampleRequest | None = None) -> StepOutput:
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = (self.length + pattern.relative_positions).to(self.device)[None]
        if self.kernel:
            tree_end = torch.tensor(pattern.tree_end, device=self.device) if pattern.is_tree else None
            step = _Step(pattern, self.length, None, torch.tensor([self.length], device=self.device), tree_end)
        else:
            step = _Step(pattern, self.length, pattern.materialize(self.length, device=self.device))
        rows = torch.tensor(list(rows), device=self.device)
        with _step_implementation(self.model):
            # top-k of every row needs the head on every row (logits_to_keep=0: all of them); a 4-D attention_mask is
            # passed on as it is, so transformers builds no mask of its own for the step
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, attention_mask=_NO_MASK,
                             logits_to_keep=0 if topk else rows, **{self.cache_keyword: self.cache, _STEP_KWARG: step})
        logits = out.logits[0]
        top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices if topk else None
        if topk:
            logits = logits[rows]
        parts = [logits.argmax(-1)]
        parts += [] if top is None else [top.flatten()]
        parts += [] if sample is None else [sample.compute(logits)]
        fetched = torch.cat(parts).cpu()  # the step's one device-to-host copy
        argmax, rest = fetched[: logits.shape[0]].tolist(), fetched[logits.shape[0] :]
        top_k = 0 if top is None else top.numel()
        return StepOutput(logits, argmax, None if top is None else rest[:top_k].view(top.shape),
                          None if sample is None else rest[top_k:].tolist())

    def commit(self, step_indices: Sequence[int]) -> None:
        keep = self.length + len(step_indices)
        for layer in self.cache.layers:
            commit_accepted(layer.keys, layer.values, self.length, step_indices)
            _drop_last(layer, layer.get_seq_length() - keep)
        self.length = keep

    def trim(self, length: int) -> None:
        """Crop the cache to its first `length` positions (after a generation: prompt + output - 1)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], got {length}")
        _drop_last(self.cache, self.length - length)
        self.length = length
