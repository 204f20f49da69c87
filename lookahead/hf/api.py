"""`lookahead.hf.generate` and `lookahead.hf.custom_generate`: the decode loop on a transformers causal LM, as a
function of its own and as `hf_model.generate(custom_generate=...)`."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lookahead.config import LookaheadConfig
from lookahead.loop import GenerationResult, decode
from lookahead.request import GenerateArgs, Request, SamplingParams, Target, check_context, check_stream, parse_request

from .step_model import HFStepModel, cache_keyword, check_model, max_positions, require_transformers
from .tuning import cost_model_for, save_if_due

DEFAULT_LOOKAHEAD = LookaheadConfig()


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
    The model is left as it was: its attention implementation is switched only during each step, and other callers
    of the model meanwhile (other threads, lookahead or not) get exactly what they get alone.
    """
    step_model = HFStepModel(hf_model, attn_backend=attn_backend)
    check_stream(stream)
    args = GenerateArgs(max_new_tokens, lookahead, temperature, top_k, top_p, seed, eos_token_id, static_step)
    target = Target(hf_model.config.vocab_size, max_positions(hf_model), _eos(hf_model.generation_config.eos_token_id),
                    step_model.device.type)
    request = parse_request(input_ids, args, target, allow_batch=False, prompt_name="input_ids")
    with torch.no_grad():
        return _decode(step_model, request, stream)


def _decode(step_model: HFStepModel, request: Request, stream) -> GenerationResult:
    """The loop on the step model, its steps sized by the model's cost model when the request self-tunes."""
    try:
        return decode(step_model, request, stream, cost=cost_model_for(step_model, request))
    finally:
        save_if_due(step_model)


def _eos(value) -> tuple[int, ...]:
    """generation_config's eos_token_id (None, an int, a list or a tensor) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    return (value,) if isinstance(value, int) else tuple(value)


def custom_generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                    generation_config=None, lookahead: LookaheadConfig | None = DEFAULT_LOOKAHEAD,
                    seed: int | None = None, static_step: bool | None = None, attn_backend: str = "auto",
                    streamer=None, **model_kwargs):
    """The decode loop as `hf_model.generate(input_ids, custom_generate=lookahead.hf.custom_generate, ...)`.

    transformers prepares the inputs, the generation config, the logits processors, the stopping criteria
    and the cache, and calls this with them; it returns what `generate` returns: the sequences tensor
    [1, prompt + new] (or a `GenerateDecoderOnlyOutput` with return_dict_in_generate=True). Its own keyword
    arguments, passed to `generate`: lookahead (default LookaheadConfig(); None: plain decoding), seed
    (default: drawn from torch's global generator, so torch.manual_seed makes sampling reproducible as it
    does for transformers), static_step and attn_backend as in `generate`.
    Greedy (do_sample=False) and sampling with temperature, top_k and top_p are honoured exactly; beam search,
    other logits processors (repetition_penalty, min_new_tokens, ...) and stopping criteria, score outputs,
    padding and batches are refused. A `streamer` given to `generate` gets what transformers' own decoding gives it:
    the prompt (transformers puts it), the new tokens as they are accepted (one `put` per step, a 1-D tensor of that
    step's tokens) and `end()`. transformers hands a custom_generate callable no streamer, so it is read from
    the calling `generate`'s arguments.
    """
    if streamer is None:
        streamer = _generate_streamer(sys._getframe(1))
    with _ending(streamer):  # after an error too, so that a reader of the streamer is not left waiting
        transformers = require_transformers()
        check_model(model)
        _check_generation_config(generation_config, input_ids)
        sampling = _sampling_params(generation_config, logits_processor or [], transformers)
        max_length, eos = _stopping(stopping_criteria or [], transformers)
        cache = model_kwargs.pop(cache_keyword(model), None)
        _check_model_kwargs(model_kwargs, input_ids)
        if seed is None and not sampling.greedy:
            seed = int(torch.randint(2**62, (), generator=torch.default_generator))
        step_model = HFStepModel(model, cache, attn_backend)
        prompt = tuple(input_ids[0].tolist())
        new = max_length - len(prompt)
        positions = max_positions(model)
        check_context(len(prompt), new, positions, held=f"max_position_embeddings ({positions})")
        tokens: list[int] = []
        if new > 0:
            static = step_model.device.type == "cuda" if static_step is None else static_step
            request = Request((prompt,), new, sampling, lookahead, frozenset(eos), (seed,), static)
            stream = None if streamer is None else lambda accepted: streamer.put(torch.tensor(accepted))
            tokens = _decode(step_model, request, stream).tokens
            step_model.trim(len(prompt) + len(tokens) - 1)  # what plain generate leaves: all but the last token
        sequences = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)], -1)
        if generation_config.return_dict_in_generate:
            return transformers.generation.GenerateDecoderOnlyOutput(sequences=sequences,
                                                                     **{step_model.cache_keyword: step_model.cache})
        return sequences


@contextlib.contextmanager
def _ending(streamer) -> Iterator[None]:
    try:
        yield
    finally:
        if streamer is not None:
            streamer.end()


def _generate_streamer(frame) -> Any:
    """The `streamer` argument of transformers' `generate` when `frame` is that call (it calls custom_generate itself),
    else None: transformers puts the prompt into it and then passes a custom_generate callable only the callable's own
    arguments, so without this the streamer would get nothing more and never `end()` (a TextIteratorStreamer's reader
    would wait for ever)."""
    if frame.f_code.co_name != "generate" or not frame.f_globals.get("__name__", "").startswith("transformers."):
        return None
    return frame.f_locals.get("streamer")


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
