"""Shared pieces of the benchmarks: machine facts, the prompts in bench/data, results on disk."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "bench" / "data" / "dev.jsonl"  # sources and licenses: bench/data/README.md
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the source package whose vendored llama.cpp converts the weights


def machine() -> dict:
    """What the figures came from: device name, CPU model, versions, git commit."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in ("triton", "transformers"):  # neither is needed to time a random model (bench/first_run.py)
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU: {cpu}",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **versions,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


COMMIT_FILE = ROOT / "bench" / "COMMIT"  # written by bench/gpu_first_run.sh where git works (git-ignored)


def git_commit() -> str:
    """The checkout's commit: git's where .git is there; else what bench/COMMIT recorded before the files were copied
    (a lent GPU host gets the working tree without .git); else a line saying neither was there."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    if commit:
        return commit
    try:
        return COMMIT_FILE.read_text(encoding="utf-8").strip() or "unknown: bench/COMMIT is empty"
    except OSError:
        return "unknown: no .git and no bench/COMMIT (run bash bench/gpu_first_run.sh --dry-run before copying)"


def device_slug() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_prompts(per_kind: int | None = None, kinds: tuple[str, ...] = ("chat", "code", "math", "summarize"),
                 skip: int = 0):
    """Rows of dev.jsonl ({id, kind, prompt}), at most `per_kind` of each kind after its first `skip` (the prompts
    a fit saw, say), in file order."""
    if not DATA.is_file():
        raise FileNotFoundError(f"{DATA} is missing: the prompt sets are part of the repository (bench/data, with "
                                "their sources and licenses); restore them with: git checkout -- bench/data")
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    picked, seen = [], {}
    for row in rows:
        if row["kind"] not in kinds:
            continue
        seen[row["kind"]] = seen.get(row["kind"], 0) + 1
        if skip < seen[row["kind"]] and (per_kind is None or seen[row["kind"]] <= skip + per_kind):
            picked.append(row)
    return picked


def held_out(count: int) -> list[dict]:
    """`count` prompts after the first two of each kind (those the defaults were tuned on), the kinds in turn."""
    by_kind: dict[str, list[dict]] = {}
    for row in load_prompts(per_kind=-(-count // 4), skip=2):
        by_kind.setdefault(row["kind"], []).append(row)
    turns = [rows[i] for i in range(max(map(len, by_kind.values()))) for rows in by_kind.values() if i < len(rows)]
    return turns[:count]


def long_prompt(tokenizer, tokens: int, head: str) -> str:
    """dev.jsonl's prompts joined after the line `head` (each use its own: no prompt then finds another's prefix in a
    server's cache), cut to `tokens` tokens of `tokenizer`: a user message's text."""
    rows, text = load_prompts(), head + "\n"
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += "\n\n".join(row["prompt"] for row in rows) + "\n\n"
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens])


def chat_ids(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def save_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{device_slug()}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cold(model) -> None:
    """Forget the prefixes the model's KV cache holds, so its next generation prefills its whole prompt. A model
    takes the cached blocks a prompt begins with (a conversation's next turn), so when methods take turns on one
    prompt, every one after the first would otherwise skip the prefill that transformers' methods pay: call this
    before each timed generation of a one-prompt comparison (bench/warm.py measures the reuse)."""
    if model.runner is not None:
        model.runner.clear_cache()


def timed(fn):
    """(fn(), its wall seconds), with the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def print_table(headers: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print(" | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def load_model(folder: str | None = None, dtype: str | None = "float32"):
    """(checkpoint folder, Llama on CUDA if there is one else CPU, its tokenizer); default: the default model. In
    float32 unless `dtype` says otherwise (None: the package's default, which depends on the CPU): the scripts'
    figures stay comparable from one machine to the next."""
    from transformers import AutoTokenizer

    from lookahead.models import Llama
    from lookahead.models.default_model import default_model_dir

    folder = Path(folder) if folder else default_model_dir()
    model = Llama.from_pretrained(folder, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    return folder, model, AutoTokenizer.from_pretrained(str(folder))


# an 8B LLaMA-3's shape (random weights stand in: a step's time depends on its shapes, not on the values)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-5)


def random_llama(shape, dtype: torch.dtype, device: str, fusion: str = "auto", backend: str | None = None,
                 **options):
    """A LLaMA of the given shape (a `LlamaConfig` or its fields) with random weights, made on the device (no
    checkpoint); fusion as `Llama.from_pretrained` takes it; backend: "triton" on CUDA, else "torch" unless given;
    `options` go to `Llama` (`batch_invariant=True` where the model has it)."""
    from lookahead.backends import choose_fusion
    from lookahead.models import Llama, LlamaConfig

    config = shape if isinstance(shape, LlamaConfig) else LlamaConfig(**shape)
    backend = backend or ("triton" if device == "cuda" else "torch")
    with torch.device("meta"):
        model = Llama(config, attn_backend=backend, fusion=choose_fusion(fusion, device, backend), **options)
    model.to(dtype).to_empty(device=device)  # the dtype on meta first: no fp32 copy of 8B parameters
    model._tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    from lookahead.models.rope import inverse_frequencies

    model.rope_inv_freq = inverse_frequencies(config.head_dim, config.rope).to(device)
    return model.eval().requires_grad_(False)


REFERENCES = Path.home() / ".cache" / "lookahead" / "greedy-references.json"


def greedy_reference(model, folder, ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy's tokens for `ids`, computed once per (checkpoint, prompt, length, device) and kept in
    ~/.cache/lookahead: greedy is deterministic, and recomputing it costs a tuning run as much as one setting."""
    key = hashlib.sha256(json.dumps([str(Path(folder).resolve()), ids, max_new_tokens, device_slug(),
                                     str(model.dtype)]).encode()).hexdigest()
    cache = json.loads(REFERENCES.read_text()) if REFERENCES.is_file() else {}
    if key not in cache:
        cache[key] = model.generate(ids, max_new_tokens=max_new_tokens).tokens
        REFERENCES.parent.mkdir(parents=True, exist_ok=True)
        tmp = REFERENCES.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache), encoding="utf-8")
        os.replace(tmp, REFERENCES)
    return cache[key]
