"""`lookahead.hf`: this package's decode loop on a Hugging Face transformers causal LM, no patching.

    import lookahead.hf
    out = lookahead.hf.generate(hf_model, input_ids, max_new_tokens=256, lookahead=LookaheadConfig())
    ids = hf_model.generate(input_ids, custom_generate=lookahead.hf.custom_generate, max_new_tokens=256)

`HFStepModel` speaks the loop's `StepModel` protocol over a transformers model and its `DynamicCache`
through the two hooks transformers supports: an attention function registered with
`AttentionInterface` (it receives q, k, v after RoPE and after the cache update; the step's pattern
reaches it as a forward keyword argument) and `generate(custom_generate=...)`. The model's
attention implementation is switched to it only for the duration of a step and restored after, so
the model is left as it was. transformers is imported here only, on first use.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lookahead.kernels import StepPattern, commit_accepted, lookahead_attention, masked_attention

from .config import LookaheadConfig
from .engine import GenerationResult, StepOutput, decode
from .inputs import eos_ids, prompt_tokens
from .sampling import SampleRequest, SamplingParams

MIN_TRANSFORMERS = "4.56"  # AttentionInterface, DynamicCache layers, callable custom_generate
ATTENTION_NAME = "lookahead"
BACKENDS = ("auto", "torch", "triton")
# attention with q/k/v projections, RoPE by position_ids and the generic attention dispatch
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE that does not depend on how many tokens one forward pass holds ("dynamic", "longrope" do)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_STEP_KWARG = "lookahead_step"
DEFAULT_LOOKAHEAD = LookaheadConfig()


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
        raise ImportError(f"lookahead.hf needs transformers >= {MIN_TRANSFORMERS} (tested with 5.23); found "
                          f"transformers {transformers.__version__}, which lacks {', '.join(missing)}")
    interface = modeling_utils.AttentionInterface
    if interface().get(ATTENTION_NAME) is not _step_attention:
        interface.register(ATTENTION_NAME, _step_attention)
    return transformers


@dataclass(frozen=True)
class _Step:
    """What every layer's attention needs for one step: the pattern, L, and the dense mask (torch only)."""

    pattern: StepPattern
    prefix_len: int
    mask: torch.Tensor | None  # [T, L + T] bool for the torch backend; None for the kernel


def _step_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention: q [B, Hq, T, D] after RoPE, k/v [B, Hkv, L + T, D] after the cache update."""
    step: _Step | None = kwargs.get(_STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside lookahead.hf steps")
    if step.mask is None:
        p = step.pattern
        tree_end = torch.tensor(p.tree_end, dtype=torch.int64, device=query.device) if p.is_tree else None
        out = lookahead_attention(query, key, value, step.prefix_len, p.window, p.ngram, p.candidates, scaling,
                                  tree_end=tree_end)
    else:
        out = masked_attention(query, key, value, step.prefix_len, step.mask, scaling)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention_implementation(model, name: str) -> Iterator[None]:
    """Select attention `name` for the calls inside, then restore the model's own (also on error)."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own


def check_model(model) -> None:
    """Refuse, naming it, a model this adapter cannot drive exactly."""
    transformers = require_transformers()
    if (not isinstance(model, transformers.PreTrainedModel) or not model.can_generate()
            or model.config.is_encoder_decoder or model.get_output_embeddings() is None):
        raise TypeError(f"hf_model must be a transformers decoder-only causal LM (e.g. LlamaForCausalLM), "
                        f"got {type(model).__name__}")
    config = model.config
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
        if attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {attn_backend!r}")
        self.model, self.device = model, model.device
        self.kernel = attn_backend == "triton" or (attn_backend == "auto" and self.device.type == "cuda")
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
        self.length = 0  # L: committed positions

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = torch.arange(self.length, self.length + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1)
        self.length += len(tokens)
        return out.logits[0, -1]

    @torch.no_grad()
    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int], topk: int = 0,
             sample: SampleRequest | None = None) -> StepOutput:
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = (self.length + pattern.relative_positions).to(self.device)[None]
        mask = None if self.kernel else pattern.materialize(self.length, device=self.device)
        step = _Step(pattern, self.length, mask)
        rows = torch.tensor(list(rows), device=self.device)
        with _attention_implementation(self.model, ATTENTION_NAME):
            # top-k of every row needs the head on every row (logits_to_keep=0: all of them)
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=0 if topk else rows, **{_STEP_KWARG: step})
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
                          None if sample is None else sample.unpack(rest[top_k:], sample.slots(logits.shape[0])))

    def commit(self, step_indices: Sequence[int]) -> None:
        keep = self.length + len(step_indices)
        for layer in self.cache.layers:
            commit_accepted(layer.keys, layer.values, self.length, step_indices)
            layer.crop(keep - layer.get_seq_length())
        self.length = keep

    def trim(self, length: int) -> None:
        """Crop the cache to its first `length` positions (after a generation: prompt + output - 1)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], got {length}")
        self.cache.crop(length - self.length)
        self.length = length


def generate(hf_model, input_ids, max_new_tokens: int = 256, lookahead: LookaheadConfig | None = DEFAULT_LOOKAHEAD,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, stream: Callable[[list[int]], None] | None = None,
             static_step: bool | None = None, attn_backend: str = "auto") -> GenerationResult:
    """Run this package's decode loop on a transformers causal LM; returns a `lookahead.GenerationResult`.

    input_ids: the prompt, a [1, T] or [T] integer tensor, a list of ints, or a tokenizer's BatchEncoding.
    lookahead: a `LookaheadConfig` (default W=1, N=4, G=5), or None for plain decoding by the same loop.
    temperature 0 is greedy (token for token what `hf_model.generate(do_sample=False)` gives, in float32);
    otherwise sampling with top_k (0 = off) and top_p, with the target distribution unchanged.
    eos_token_id: an int or a list (default: the model's generation_config; [] never stops early).
    stream: called with each step's accepted tokens as they are decided.
    static_step: pad every step to the configuration's full size (one step shape); None = on CUDA only.
    attn_backend: "auto" (the Triton kernel on CUDA, the SDPA reference elsewhere), "torch" or "triton".
    The model is left as it was: its attention implementation is switched only during each step.
    """
    step_model = HFStepModel(hf_model, attn_backend=attn_backend)
    prompt = prompt_tokens(input_ids, hf_model.config.vocab_size, name="input_ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be callable or None, got {type(stream).__name__}")
    _check_options(lookahead, seed, static_step)
    sampling = SamplingParams(temperature, top_k, top_p)
    eos = eos_ids((), hf_model.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
    static = step_model.device.type == "cuda" if static_step is None else static_step
    with torch.no_grad():
        return decode(step_model, prompt, max_new_tokens, sampling, lookahead, eos, stream, seed, step_model.device,
                      static_step=static)


def custom_generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                    generation_config=None, lookahead: LookaheadConfig | None = DEFAULT_LOOKAHEAD,
                    seed: int | None = None, static_step: bool | None = None, attn_backend: str = "auto",
                    **model_kwargs):
    """The decode loop as `hf_model.generate(input_ids, custom_generate=lookahead.hf.custom_generate, ...)`.

    transformers prepares the inputs, the generation config, the logits processors, the stopping criteria
    and the cache, and calls this with them; it returns what `generate` returns: the sequences tensor
    [1, prompt + new] (or a `GenerateDecoderOnlyOutput` with return_dict_in_generate=True). Its own keyword
    arguments, passed to `generate`: lookahead (default LookaheadConfig(); None: plain decoding), seed
    (default: drawn from torch's global generator, so torch.manual_seed makes sampling reproducible as it
    does for transformers), static_step and attn_backend as in `generate`.
    Greedy (do_sample=False) and sampling with temperature, top_k and top_p are honoured exactly; beam search,
    other logits processors (repetition_penalty, min_new_tokens, ...) and stopping criteria, score outputs,
    padding and batches are refused. transformers does not hand a `streamer` to a custom_generate callable.
    """
    transformers = require_transformers()
    check_model(model)
    _check_options(lookahead, seed, static_step)
    _check_generation_config(generation_config, input_ids)
    sampling = _sampling_params(generation_config, logits_processor or [], transformers)
    max_length, eos = _stopping(stopping_criteria or [], transformers)
    cache = model_kwargs.pop("past_key_values", None)
    _check_model_kwargs(model_kwargs, input_ids)
    if seed is None and not sampling.greedy:
        seed = int(torch.randint(2**62, (), generator=torch.default_generator))
    step_model = HFStepModel(model, cache, attn_backend)
    prompt = input_ids[0].tolist()
    new = max_length - len(prompt)
    tokens: list[int] = []
    if new > 0:
        static = step_model.device.type == "cuda" if static_step is None else static_step
        tokens = decode(step_model, prompt, new, sampling, lookahead, eos, None, seed, step_model.device,
                        static_step=static).tokens
        step_model.trim(len(prompt) + len(tokens) - 1)  # what plain generate leaves: all but the last token
    sequences = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)], -1)
    if generation_config.return_dict_in_generate:
        return transformers.generation.GenerateDecoderOnlyOutput(sequences=sequences,
                                                                 past_key_values=step_model.cache)
    return sequences


def _check_options(lookahead, seed, static_step) -> None:
    if lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise TypeError(f"lookahead must be None or a LookaheadConfig, got {type(lookahead).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if static_step is not None and not isinstance(static_step, bool):
        raise TypeError(f"static_step must be a bool or None, got {static_step!r}")


def _check_generation_config(config, input_ids: torch.Tensor) -> None:
    mode = config.get_generation_mode()
    if mode.value not in ("greedy_search", "sample"):
        raise ValueError(f"lookahead.hf runs greedy decoding or sampling, not {mode.value} "
                         f"(num_beams={config.num_beams}); drop the options that select it")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"lookahead.hf generates one sequence at a time; got input_ids of shape "
                         f"{tuple(input_ids.shape)} (num_return_sequences={config.num_return_sequences})")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(config, name, False):
            raise ValueError(f"lookahead.hf cannot return what {name}=True asks for")


def _sampling_params(config, processors, transformers) -> SamplingParams:
    """The temperature, top-k and top-p that transformers' warpers would apply; anything else is refused."""
    process = transformers.generation.logits_process
    names = {process.TemperatureLogitsWarper: "temperature", process.TopKLogitsWarper: "top_k",
             process.TopPLogitsWarper: "top_p"}
    values: dict[str, Any] = {}
    for processor in processors:
        name = names.get(type(processor)) if config.do_sample else None
        if name is None or name in values or getattr(processor, "min_tokens_to_keep", 1) != 1:
            raise ValueError(f"lookahead.hf cannot honour the logits processor {type(processor).__name__} "
                             "(it runs plain greedy decoding or temperature / top_k / top_p sampling only)")
        values[name] = getattr(processor, name)
    if not config.do_sample:
        return SamplingParams()
    return SamplingParams(values.get("temperature", 1.0), values.get("top_k", 0), values.get("top_p", 1.0))


def _stopping(criteria, transformers) -> tuple[int, list[int]]:
    stopping = transformers.generation.stopping_criteria
    max_length, eos = None, []
    for criterion in criteria:
        if type(criterion) is stopping.MaxLengthCriteria:
            max_length = criterion.max_length
        elif type(criterion) is stopping.EosTokenCriteria:
            eos = criterion.eos_token_id.flatten().tolist()
        else:
            raise ValueError(f"lookahead.hf cannot honour the stopping criterion {type(criterion).__name__} "
                             "(it stops at max_length / max_new_tokens and eos_token_id only)")
    if max_length is None:
        raise ValueError("lookahead.hf needs max_length or max_new_tokens")
    return max_length, eos


def _check_model_kwargs(kwargs: dict, input_ids: torch.Tensor) -> None:
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("lookahead.hf cannot run a padded prompt (attention_mask has zeros)")
    positions = kwargs.pop("position_ids", None)
    if positions is not None and positions.flatten().tolist() != list(range(input_ids.shape[-1])):
        raise ValueError("lookahead.hf sets the positions itself; position_ids must be 0..T-1")
    for ignored in ("use_cache", "logits_to_keep", "cache_position"):
        kwargs.pop(ignored, None)
    if kwargs:
        raise ValueError(f"lookahead.hf cannot honour the model inputs {sorted(kwargs)}")
