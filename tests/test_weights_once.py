"""`Llama.keep_weights_once`: the batch-invariant mode's packed weights as the one copy in memory (issue 48, item 6).
The model then computes the same bits as one that keeps its parameters, and its resident memory is about its weights'
bytes plus the KV cache, where the mode otherwise holds two copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.models import Llama

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CHECKPOINTS = {"untied": {}, "tied": {"tie_word_embeddings": True}, "qwen2 biases": {"family": "qwen2"}}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_weights_kept_once_give_the_bits_of_the_model_that_keeps_them(tiny_checkpoint, dtype, checkpoint):
    """Every linear's parameter released (a tied embedding's too, its rows then read from the packed head; a bias and
    the norms kept): each position's logits bitwise those of the same model keeping its parameters, in the layers'
    one call and run one by one, and greedy decoding with lookahead gives the same tokens."""
    from lookahead.models.invariant import InvariantOps

    folder = tiny_checkpoint(checkpoint, **CHECKPOINTS[checkpoint])
    keeps = Llama.from_pretrained(folder, dtype=dtype, batch_invariant=True)
    once = Llama.from_pretrained(folder, dtype=dtype, batch_invariant=True)
    assert once.uses_cpu_kernels, "the CPU kernels did not build here"
    weights = {id(p): p.numel() * p.element_size() for name, p in once.named_parameters(remove_duplicate=False)
               if name.endswith("proj.weight") or name == "lm_head.weight"}
    assert once.keep_weights_once() == sum(weights.values())
    released = {name for name, p in once.named_parameters(remove_duplicate=False) if p.is_meta}
    linears = {name for name, _ in once.named_parameters(remove_duplicate=False)
               if name.endswith("proj.weight") or name == "lm_head.weight"}
    tied = "model.embed_tokens.weight" if checkpoint == "tied" else None
    assert released == linears | ({tied} if tied else set())
    assert all(not p.is_meta for name, p in once.named_parameters() if "norm" in name or name.endswith("bias"))
    ids = torch.tensor([[5, 17, 99, 3, 42, 42, 8, 61, 0, 100, 7, 29]])
    for whole_step in (True, False):
        InvariantOps.whole_step = whole_step
        try:
            assert torch.equal(once(ids), keeps(ids)), whole_step
        finally:
            InvariantOps.whole_step = True
    prompt = [5, 17, 99, 3, 42, 8, 61, 0, 100, 7]
    for lookahead in (None, LookaheadConfig()):
        assert (once.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=lookahead).tokens
                == keeps.generate(prompt, max_new_tokens=24, eos_token_id=[], lookahead=lookahead).tokens)


def test_keeping_weights_once_needs_the_cpu_kernels_and_a_released_weight_is_never_read_silently(tiny_checkpoint):
    """Without the mode's CPU kernels the parameters are what the model computes with: refused, saying why. After it,
    a released weight holds no values: computing with one raises rather than giving numbers."""
    folder = tiny_checkpoint("gqa")
    with pytest.raises(ValueError, match="batch-invariant mode on the package's CPU kernels"):
        Llama.from_pretrained(folder, batch_invariant=False).keep_weights_once()
    model = Llama.from_pretrained(folder, batch_invariant=True)
    model.keep_weights_once()
    assert model.keep_weights_once() == 0  # twice: nothing left to release
    with pytest.raises((NotImplementedError, RuntimeError)):
        model.model.layers[0].mlp.down_proj.weight.sum().item()


def test_the_default_model_with_weights_once_is_resident_in_about_its_weights_and_kv(default_model_dir):
    """Issue 48's goal, by `bench/memory.py --quick`: in a fresh process the default model in the mode (float32, its
    weights released), after decoding with and without lookahead, holds at most 1.2x its weights' bytes plus its KV
    cache over torch and the package imported (two copies, as the mode keeps otherwise, are about 2x)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "memory.py"
    done = subprocess.run([sys.executable, str(bench), "--quick", "--model", str(default_model_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["released"] >= 0.95 * got["weights"]  # the default model's linears are nearly all of it (tied head)
    assert got["decoded"] <= 1.2 * (got["weights"] + got["kv"]), got
