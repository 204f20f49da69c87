"""A minimal LLaMA (`Llama`, its blocks in `blocks.py`): Hugging Face parameter names; loaded from a checkpoint folder
(`loading.py`) or a GGUF file (`gguf.py`) on the device and in the dtype `placement.py` chooses."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from torch import nn

from lookahead.config import LookaheadConfig
from lookahead.drafts import DraftMemory
from lookahead.loop import GenerationResult
from lookahead.tuning import CostModel
from lookahead.tuning.store import Saver

from .attention import Attend, causal, invariant_causal
from .blocks import Backbone
from .config import LlamaConfig
from .fusion import MergedLinears, TorchOps, TritonOps
from .generation import Expected, generate, warmup
from .gguf import gguf_file
from .gguf import load as load_gguf
from .invariant import InvariantOps
from .loading import load_folder
from .placement import check_invariant, place, warn_leaving_the_mode
from .rope import Angles, inverse_frequencies
from .runner import CachedRunner

COMPILED_SHAPES = 256  # step shapes fusion="compile" compiles for one model (torch._dynamo's default limit is 8)


class Llama(nn.Module):
    """A LLaMA-shaped causal LM (LLaMA, Mistral, Qwen2/Qwen2.5, Qwen3 dense: `LlamaConfig`'s fields tell them
    apart). Build with `Llama.from_pretrained(folder)`; decode with `generate`."""

    def __init__(self, config: LlamaConfig, attn_backend: str = "torch", fusion: str = "none",
                 batch_invariant: bool = False) -> None:
        """attn_backend: "torch" or "triton"; fusion: "none", "triton" or "compile"; batch_invariant: the mode in
        which a position's logits are bitwise the same whatever the step (see `from_pretrained`)."""
        super().__init__()
        if fusion not in ("none", "triton", "compile"):
            raise ValueError(f"fusion must be 'none', 'triton' or 'compile' here, got {fusion!r} ('auto' is resolved "
                             "by from_pretrained, or by lookahead.backends.choose_fusion for a device)")
        check_invariant(batch_invariant, fusion)
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_weights()
        self.register_buffer("rope_inv_freq", inverse_frequencies(config.head_dim, config.rope), persistent=False)
        self.attn_backend = attn_backend
        self.fusion = fusion
        self.dtype_reason: str | None = None  # why from_pretrained chose the dtype it loaded in (`default_dtype`)
        self._warn_without_the_mode = False  # a 16-bit dtype chosen for the mode (`Placement.for_the_mode`): once
        self._batch_invariant = batch_invariant
        self._invariant_ops = InvariantOps()  # the mode's float32 GEMMs (and 16-bit weights' fp32 copies)
        self._compiled_forward = None  # fusion "compile": the step's forward, compiled on its first step
        self.runner: CachedRunner | None = None  # the KV cache, plans and graphs generations reuse (`generate`)
        self.lock = threading.RLock()  # generations on one model share its runner: they take turns
        # what a step costs on this machine, which self-tuned steps are sized by: read from the disk cache or
        # measured before the first generation that needs it (`models.tuning`); set one to fix the costs
        self.cost_model: CostModel | None = None
        self.cost_saver = Saver()  # writes it back to its cache file as the steps keep it current
        self.measuring_seconds = 0.0  # time this model has spent measuring step costs (none where a file had them)
        # what drafting learned, kept across generations with LookaheadConfig(warm=True): `draft_memory.clear()`
        self.draft_memory = DraftMemory()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str = "cpu", attn_backend: str = "auto", fusion: str = "auto",
                        batch_invariant: bool | None = None) -> Llama:
        """Load a Hugging Face checkpoint folder (config.json + model.safetensors, sharded or not) of model_type
        llama, mistral, qwen2 or qwen3; other architectures are refused (`lookahead.hf` decodes transformers models).
        Or a llama.cpp GGUF file (a path ending in .gguf, or a folder holding one and no safetensors) of architecture
        llama, qwen2 or qwen3: its quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) stay quantized in
        memory on a CPU and are multiplied by the package's kernels, bitwise batch-invariant like every other weight
        (`models.gguf`; on CUDA they are dequantized to `dtype` at load, with a warning).

        dtype: float32, float16 or bfloat16. None: $LOOKAHEAD_DTYPE where it is set, else bfloat16 on CUDA and on
        a CPU with bf16 dot products (AMX, AVX512-BF16, Arm BF16) where `batch_invariant` is on, else float32
        (`default_dtype`; `dtype_reason` says which rule chose it). Lookahead decoding is token for token plain
        greedy in float32; in 16-bit a multi-token pass rounds differently from a one-token pass, so near-ties
        can flip, unless `batch_invariant`.
        batch_invariant: a position's logits are bitwise the same whatever step computes them (a plain step, a
        lookahead step of any shape, the rows packed beside it, how its prompt was chunked, a cached prefix), so
        lookahead and batches give plain greedy's tokens bitwise in every dtype. None (the default): on for a CPU
        with the torch backend and fusion "auto" or "none" (there it is faster than the mode off: the package's
        compiled kernels, built once per machine on the first load), off on CUDA (unmeasured there). GEMMs
        accumulate in float32 computing each row alike, and attention reduces each query's keys in position order
        (docs/DESIGN.md, "Batch invariance"); fusion is "none" and steps run eagerly (no CUDA graphs). The property
        of the same name switches it later.
        attn_backend: "auto" (Triton on CUDA, torch on CPU), "torch", or "triton" (on CPU only under
        TRITON_INTERPRET=1).
        fusion: how the small ops around the GEMMs and attention run (norms, RoPE, residual adds, SiLU; about 700
        kernels of an 8B step): "none" (the torch ops, one kernel each), "triton" (q/k/v and gate/up each one GEMM,
        the rest hand-fused Triton kernels: `lookahead.kernels.add_rms_norm`, `rotary_`, `silu_mul`), "compile"
        (the same merged GEMMs and torch ops, each step shape's forward compiled by `torch.compile(fullgraph=True,
        dynamic=False)` on its first use), or "auto": "triton" on CUDA with the Triton attention backend, "none"
        elsewhere (no compile per step shape, the same code every time, and it captures into CUDA graphs).
        "triton" on CPU only under TRITON_INTERPRET=1.

        device: "cpu" or "cuda" (others, "meta" or "mps" say, are refused).

        Refused with an error naming the field, tensor or file: config fields of the wrong type or out of
        range, sliding windows shorter than max_position_embeddings, tensor shapes that differ from config.json's
        (checked from the file headers before anything is allocated), integer, bool, NaN or inf weights, index
        entries outside the folder or tensors in the wrong shard. With
        tie_word_embeddings and both embed_tokens and lm_head in the file, does what transformers does:
        ties them if they are equal, else keeps the file's lm_head and warns.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a checkpoint folder (str or Path), got {type(path).__name__}")
        if not str(path).strip():
            raise ValueError(f"path must name a checkpoint folder, got {str(path)!r}")
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint folder {path} does not exist")
        gguf = gguf_file(path)
        if gguf is None and not path.is_dir():
            raise ValueError(f"{path} is neither a checkpoint folder nor a GGUF file (.gguf)")
        at = place(device, dtype, attn_backend, fusion, batch_invariant)
        options = dict(attn_backend=at.attn_backend, fusion=at.fusion, batch_invariant=at.batch_invariant)
        if gguf is not None:
            model = load_gguf(cls, gguf, at.dtype, at.device, **options)
        else:
            model = load_folder(cls, path, at.dtype, at.device, **options)
        model.dtype_reason, model._warn_without_the_mode = at.dtype_reason, at.for_the_mode
        return model.eval().requires_grad_(False)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, `.cuda()` all pass here: the RoPE table moves with the model but stays fp32."""
        inv_freq = self.rope_inv_freq
        super()._apply(fn, recurse)
        if self.rope_inv_freq.dtype != torch.float32:
            self.rope_inv_freq = inv_freq.to(device=self.rope_inv_freq.device, dtype=torch.float32)
        return self

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cost_model(self) -> CostModel | None:
        """What a step costs on this machine, which self-tuned steps are sized by: read from the disk cache or measured
        before the first generation that needs it (`models.tuning`). Set one (a `CostModel` with an empty key) to fix
        the costs, or None to measure again; anything else is refused here, not deep inside a generation."""
        return self._cost_model

    @cost_model.setter
    def cost_model(self, value: CostModel | None) -> None:
        if value is not None:
            if not isinstance(value, CostModel):
                raise TypeError(f"cost_model must be a lookahead.tuning.CostModel or None, got {type(value).__name__}")
            value.check()  # its curves' lists may have been changed since they were built
        self._cost_model = value

    @property
    def draft_memory(self) -> DraftMemory:
        """What drafting learned, kept across generations with `LookaheadConfig(warm=True)`: `draft_memory.clear()`
        empties it; set another `DraftMemory` (a larger cap, say); anything else is refused here."""
        return self._draft_memory

    @draft_memory.setter
    def draft_memory(self, value: DraftMemory) -> None:
        if not isinstance(value, DraftMemory):
            raise TypeError(f"draft_memory must be a lookahead.drafts.DraftMemory, got {type(value).__name__} "
                            "(call draft_memory.clear() to empty it)")
        self._draft_memory = value

    @property
    def batch_invariant(self) -> bool:
        """Whether a position's logits are bitwise the same whatever step computes them (`from_pretrained`). Setting
        it drops the runner (its KV cache holds what the other mode computed); switching it off on a model loaded in
        16-bit because the mode keeps that exact warns, once (`placement.warn_leaving_the_mode`)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, value: bool) -> None:
        if value is not True and value is not False:
            raise TypeError(f"batch_invariant must be True or False, got {value!r}")
        check_invariant(value, self.fusion)
        if not value and self._batch_invariant and self._warn_without_the_mode and self.dtype != torch.float32:
            self._warn_without_the_mode = False
            warn_leaving_the_mode(self.dtype)
        if value != self._batch_invariant:
            with self.lock:
                self._batch_invariant = value
                self.runner = None

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether the batch-invariant mode runs on the package's compiled CPU kernels here
        (`lookahead.kernels.cpu_kernels`; compiled on the first call, once per machine): its GEMMs, attention and whole
        decoder layers; else on torch's GEMMs through row plans. The mode on and `invariant.runs_cpu_kernels` for the
        model's device: what the runner's attention, the cost key and the mode's linears follow."""
        return self._batch_invariant and self._invariant_ops.runs_cpu_kernels(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype  # the activations' (a GGUF model's quantized head is no float tensor)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # (kept by `keep_weights_once`, which releases the linears')

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention: Attend | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, R, vocab] for the rows `rows`: an index tensor [R], or [B, R] per row).

        positions: [T] absolute positions, or [B, T] per row (default 0..T-1). attention: how each layer
        attends, `attention(layer, q, k, v)` (default: plain causal over these tokens, no cache).
        Without `attention` (a caller's own forward) the ids are checked: an integer tensor on the model's device,
        every id in [0, vocab_size), else `TypeError`/`ValueError`. With it (the runner's steps) they are not,
        so a step reads nothing back from the device.
        """
        if attention is None:  # a caller's own forward (the runner always passes its attention): check the ids
            self._check_input_ids(input_ids)
            self.merge_weights()  # parameters a caller replaced reach the merged GEMMs
        elif input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        attend = attention if attention is not None else invariant_causal if self._batch_invariant else causal
        if self._batch_invariant:
            return self._invariant_forward(input_ids, positions, attend, rows)
        x = self.model.embed_tokens(input_ids)
        if self.fusion != "none":
            return self._merged_forward(x, positions, attend, rows)
        angles = Angles.at(self.rope_inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, angles, i, attend)
        return self.lm_head(self.model.norm(_take_rows(x, rows)))

    def _invariant_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                           rows: torch.Tensor | None) -> torch.Tensor:
        """The batch-invariant mode: the whole step in one call of the CPU kernels where it applies, else op by op,
        every linear by `InvariantOps` (norms, RoPE and SiLU are per row already)."""
        ops = self._invariant_ops
        logits = ops.decoder_step(self.model, self.lm_head, input_ids, positions, self.rope_inv_freq, attend, rows)
        if logits is not None:
            return logits
        x = ops.embed(self.model.embed_tokens, input_ids)  # (a tied embedding released with the head: its packed rows)
        angles = Angles.at(self.rope_inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, angles, i, attend, ops)
        return ops(self.lm_head, ops.norm(self.model.norm, _take_rows(x, rows)))

    def _merged_forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend,
                        rows: torch.Tensor | None) -> torch.Tensor:
        """fusion "triton" or "compile": merged GEMMs, each residual add fused with the norm after it."""
        ops = (TritonOps(self.rope_inv_freq, positions) if self.fusion == "triton"
               else TorchOps(self.rope_inv_freq, positions, x.dtype))
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer.merged_forward(x, residual, ops, i, attend)
        x, _ = ops.norm(x, residual, self.model.norm)
        return self.lm_head(_take_rows(x, rows))

    def step_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attend,
                     rows: torch.Tensor | None) -> torch.Tensor:
        """The forward of a runner's step (the region a CUDA graph captures): `forward`, compiled under
        fusion "compile" (`torch.compile(fullgraph=True, dynamic=False)`: one compile per step shape, on its
        first use; the recompile limit is raised to `COMPILED_SHAPES` for these calls, since self-tuned sizes and
        shrinking batches meet many shapes, and `fullgraph` fails past it rather than run eagerly)."""
        if self.fusion != "compile":
            return self(input_ids, positions, attention, rows)
        if self._compiled_forward is None:
            self._compiled_forward = torch.compile(self.forward, fullgraph=True, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES):
            return self._compiled_forward(input_ids, positions, attention, rows)

    def merge_weights(self) -> bool:
        """Merge again the q/k/v and gate/up weights of any layer whose parameters were replaced since (for example
        by `load_state_dict(..., assign=True)`), so the merged GEMMs read them, and then drop the runner: its KV
        cache and CUDA graphs hold what the old weights computed. Returns whether any layer was merged again."""
        merged = any([module.merge() for module in self.modules() if isinstance(module, MergedLinears)])
        if merged:
            self.release()
        return merged

    def _check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Ids a caller hands to `model(ids)`: an integer [B, T] tensor on the model's device, inside the vocabulary.
        Reads the ids' range on the host (one sync), so the runner's per-step forward does not come here."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor [B, T] of token ids, got {type(input_ids).__name__}")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids are on {input_ids.device}, the model on {self.device}: move them with "
                             f".to({str(self.device)!r})")
        if input_ids.numel():
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one device-to-host copy
            vocab = self.config.vocab_size
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab})")

    def generate(self, prompt_ids, max_new_tokens: int = 256, lookahead: LookaheadConfig | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 eos_token_id=None, stream=None, static_step: bool | None = None,
                 cuda_graph: bool = True, process_group=None) -> GenerationResult | list[GenerationResult]:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (a list of ints or a 1-D tensor), or after
        each prompt of a batch.

        prompt_ids: one prompt (a list of ints, a 1-D or [1, T] tensor, a tokenizer's output) returns one
            `GenerationResult`; a batch (a list of prompts, each a list of ints or a 1-D tensor, lengths may
            differ; `[[1, 2, 3]]` is a batch of one) returns a list of them, one per prompt, each what that
            prompt would give alone. A batch decodes all rows in one forward pass per step (each row's step its
            own size); a row that finishes (EOS, token limit) leaves the batch.
        lookahead: None for plain decoding, a `lookahead.LookaheadConfig` for lookahead decoding (per row), or
            "auto": `LookaheadConfig.auto` for the model's device, self-tuned per row and step (a row takes only
            the draft nodes that pay for the whole step, none where nothing does).
        Exact: with temperature 0 the output is plain greedy decoding's, token for token, in float32 (in
        16-bit types a multi-token pass rounds differently from a one-token pass, so near-ties can
        flip); with sampling the output distribution is unchanged.
        temperature 0 is greedy; otherwise sampling with top_k (0 = off) and top_p, reproducible with seed.
        seed: for a batch, a list (one per prompt) or an int s (row i gets s + i, so it samples exactly as
            that prompt alone with seed s + i); each row has its own random source, untouched by the others.
        eos_token_id: an int or a list (default: the checkpoint's; [] never stops early).
        stream: called with each step's accepted tokens (a list of ints) as they are decided; for a batch,
            called as stream(prompt index, tokens).
        static_step: pad every decoding step to one of a few shapes (each row to its chosen size's full shape, and
            the packed step to a bucket: a multiple of 16 tokens up to 128, then a power of two), so a generation
            meets few step shapes (one CUDA graph each); None = on CUDA only (on a CPU padding costs real
            compute). The tokens are the same either way.
        cuda_graph: on CUDA with static steps and the Triton backend, capture each step shape once as
            a CUDA graph and replay it; False runs every step eagerly (for debugging).

        process_group: a `torch.distributed` process group of K ranks, each a process that holds the same
            model and calls `generate` with the same arguments (checked): lookahead parallelism. The
            `lookahead` configuration describes the whole step, whose W columns and verification budget are
            divided among the ranks (each computes its share plus the input and the level-0 tokens its
            columns read), one all-gather per step exchanges what verification reads, and the accepted
            entries' KV are broadcast from the rank that computed them. Every rank returns the same result,
            the one a single process gives (tokens and steps). "auto" scales the defaults with K (W = K,
            G = 5K). One prompt only; gloo on CPU, NCCL on CUDA; set a timeout in `init_process_group` so a
            rank that dies makes the others raise. `stream` is each rank's own (pass one on rank 0 to print once).

        Returns a `lookahead.GenerationResult` with `tokens`, `steps` (forward passes, the prefill counted once)
        and `compression` (tokens / steps), and `cached_tokens`: the prompt positions taken from the KV cache
        (full blocks of a prefix earlier generations computed: a conversation's earlier turns, a shared system
        prompt) instead of prefilled.

        Threads: calls on one model take turns (a lock): they share its KV cache (`runner`). For concurrent
        generations, batch the prompts into one call, or serve them through an engine
        (`lookahead.models.engine_for(model)`: requests join and leave a running batch from any thread).
        """
        return generate(self, prompt_ids, max_new_tokens=max_new_tokens, lookahead=lookahead,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_token_id=eos_token_id, stream=stream, static_step=static_step,
                        cuda_graph=cuda_graph, process_group=process_group)

    def warmup(self, lookahead: LookaheadConfig | str | None = None, max_tokens: int = 2048,
               cuda_graph: bool = True, batch: int = 1, sampling: bool = False, process_group=None,
               static_step: bool | None = None) -> None:
        """Allocate the KV cache, measure the machine's cost model if there is none, and with static steps (the
        default on CUDA; `static_step`) compile the kernels and capture the CUDA graphs of every step shape that
        generations with `lookahead` of up to `max_tokens` tokens (prompt + output) and up to `batch` prompts will
        decode with (every row count up to `batch`, every padded size their steps can take), so that no generation
        pays for them midway. Steps that carry a prompt chunk run eagerly. Without it each shape is prepared on its
        first use. `sampling` measures the sampled steps' cost curve too; with `process_group` (lookahead
        parallelism, called on every rank) it prepares the runner only."""
        warmup(self, Expected(lookahead, max_tokens, batch, sampling, static_step), cuda_graph, process_group)

    def keep_weights_once(self) -> int:
        """Keep each linear's weight once in memory: as the batch-invariant mode's CPU kernels read it (packed now,
        the copy the mode's steps use anyway), releasing the parameters, which the mode then never reads. Without
        it the mode keeps both, about twice the weights' bytes. For programs that never read the model's weights
        again: `lookahead generate` and `lookahead serve` call it. Afterwards the linears' parameters (and a tied
        embedding's, whose rows then come from the packed head) are on the meta device, with their shapes and dtypes:
        computing with one, turning the mode off or moving the model raises; load the model again for those. Returns
        the bytes released. ValueError where the mode does not run on the CPU kernels (`uses_cpu_kernels`)."""
        if not self.uses_cpu_kernels:
            raise ValueError("keep_weights_once needs the batch-invariant mode on the package's CPU kernels "
                             f"(batch_invariant={self._batch_invariant}, device {self.device}): without them the "
                             "mode reads the parameters themselves")
        with self.lock:
            released = self._invariant_ops.keep_once(self, self.model.layers, self.lm_head)
            self.release()  # the parameters changed: the runner starts afresh
            return released

    def kept_weight(self, linear: nn.Linear) -> torch.Tensor:
        """What holds a linear's weight after `keep_weights_once`: its packed blocks (the values, laid out for the
        kernel). RuntimeError for a weight not packed alone (q/k/v and gate/up are packed side by side)."""
        return self._invariant_ops.kept_copy(linear.weight).blocks

    def release(self) -> None:
        """Free the KV cache, kernel plans and CUDA graphs kept between generations (`runner`); the next generation
        builds them again. The cache grows to the largest request met (a large batch, a long prompt) and stays.
        (Weights changed in place need no call: the runner notices them by the parameters' version counters and
        resumes from no cached prefix.)"""
        with self.lock:
            self.runner = None


def _take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, C] at `rows`: [R] for every row or [B, R] per row (None: all of them)."""
    if rows is None:
        return x
    return x[:, rows] if rows.ndim == 1 else x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
