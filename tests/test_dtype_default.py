"""The dtype a model loads in where none is given (issue 36): bfloat16 on a CPU with bf16 dot products while the
batch-invariant mode keeps it exact, float32 elsewhere on a CPU, $LOOKAHEAD_DTYPE over both; and the command says
which it chose and why. The suite pins float32 through $LOOKAHEAD_DTYPE (conftest.py); these tests unset it."""

from __future__ import annotations

import pytest
import torch

import lookahead.models.invariant as invariant
import lookahead.models.placement as placement
from lookahead import LookaheadConfig
from lookahead.cli import main
from lookahead.cli.report import Notes, Timed, dtype_choice, summary
from lookahead.kernels.cpu_kernels import bf16_dot_products
from lookahead.loop import GenerationResult
from lookahead.models import Llama
from lookahead.models.placement import default_dtype

X86_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw {extra}\nmodel name\t: Some CPU\n"
ARM_FEATURES = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 {extra}\n"


@pytest.mark.parametrize("cpuinfo, feature", [
    (X86_FLAGS.format(extra="avx512_bf16"), "avx512_bf16"),
    (X86_FLAGS.format(extra="avx512_bf16 amx_bf16 amx_tile"), "amx_bf16"),  # AMX named first where both are there
    (X86_FLAGS.format(extra="avx512_vnni"), None),
    (ARM_FEATURES.format(extra="i8mm bf16 sve2"), "bf16"),
    (ARM_FEATURES.format(extra="sve2"), None),
    ("model name\t: bf16 in the name only\n", None),  # a feature is read from the flags lines alone
    ("", None),
], ids=["avx512-bf16", "amx", "x86-without", "arm-bf16", "arm-without", "name-only", "empty"])
def test_bf16_dot_products_are_read_from_the_cpus_flags(cpuinfo, feature):
    assert bf16_dot_products(cpuinfo) == feature


@pytest.fixture
def unpinned(monkeypatch):
    """$LOOKAHEAD_DTYPE unset, and a CPU with AVX512-BF16 (`set(None)` makes it one without)."""
    monkeypatch.delenv("LOOKAHEAD_DTYPE")

    class Cpu:
        feature: str | None = "avx512_bf16"

        def set(self, feature):
            self.feature = feature

    cpu = Cpu()
    monkeypatch.setattr(placement, "bf16_dot_products", lambda: cpu.feature)
    return cpu


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_default_follows_the_cpu_and_the_mode(unpinned):
    dtype, reason = default_dtype(CPU, batch_invariant=True)
    assert dtype == torch.bfloat16 and "avx512_bf16" in reason and "batch-invariant" in reason
    assert default_dtype(CPU, batch_invariant=False)[0] == torch.float32  # 16-bit would flip near-ties
    assert default_dtype(CUDA, batch_invariant=False)[0] == torch.bfloat16
    unpinned.set(None)
    dtype, reason = default_dtype(CPU, batch_invariant=True)
    assert dtype == torch.float32 and reason == "this CPU has no bf16 dot products"


def test_without_the_cpu_kernels_the_default_stays_float32(unpinned, monkeypatch):
    """Without a compiler the mode runs torch's GEMMs on float32 copies of the weights: bfloat16 gains nothing."""
    monkeypatch.setattr(invariant, "cpu_kernels_built", lambda: False)
    monkeypatch.setattr(placement, "failure", lambda: "no C++ compiler found (c++: not found)")
    assert default_dtype(CPU, batch_invariant=True) == (
        torch.float32, "the package's CPU kernels could not be built here: no C++ compiler found (c++: not found)")


def test_the_environment_names_the_default(unpinned, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_DTYPE", "float16")
    assert default_dtype(CPU, batch_invariant=True) == (torch.float16, "$LOOKAHEAD_DTYPE")
    monkeypatch.setenv("LOOKAHEAD_DTYPE", "fp32")
    with pytest.raises(ValueError, match=r"LOOKAHEAD_DTYPE='fp32' is not a dtype; set it to one of float32, "):
        default_dtype(CPU, batch_invariant=True)


def test_from_pretrained_loads_in_the_default_and_keeps_lookahead_exact(unpinned, tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert model.batch_invariant and model.dtype == torch.bfloat16 and "avx512_bf16" in model.dtype_reason
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = [1, 5, 9, 5, 9, 5, 9, 3, 7, 5, 9, 5]
    plain = model.generate(prompt, max_new_tokens=24, eos_token_id=[]).tokens
    ahead = model.generate(prompt, max_new_tokens=24, eos_token_id=[],
                           lookahead=LookaheadConfig(2, 3, 4, budget="fixed")).tokens
    assert ahead == plain  # the mode the default leans on: bf16 lookahead is plain greedy bitwise
    assert Llama.from_pretrained(tiny_checkpoint("gqa"), batch_invariant=False).dtype == torch.float32
    asked = Llama.from_pretrained(tiny_checkpoint("gqa"), dtype="float32")
    assert asked.dtype == torch.float32 and asked.dtype_reason == "asked for" and dtype_choice(asked) is None


def test_switching_the_mode_off_warns_once_where_the_dtype_was_chosen_for_it(unpinned, monkeypatch, tiny_checkpoint):
    """A model loaded in bfloat16 because the batch-invariant mode keeps it exact loses that exactness with the mode:
    switching it off warns once, at the line that switched it, saying what can now flip and how to keep exactness.
    A 16-bit dtype asked for, a float32 default, or a model since moved to float32 switches off quietly."""
    import warnings

    monkeypatch.setattr(invariant, "cpu_kernels_built", lambda: True)  # the default's rule, whatever the build here
    folder = tiny_checkpoint("gqa")
    model = Llama.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.batch_invariant
    with pytest.warns(UserWarning, match=r"batch_invariant switched off on a model loaded in bfloat16 because the "
                      r"batch-invariant mode keeps 16-bit exact: near-tied logits can now flip .* To keep exactness "
                      r"keep the mode on, or load with dtype=torch\.float32") as caught:
        model.batch_invariant = False
    assert len(caught) == 1 and caught[0].filename == __file__ and not model.batch_invariant
    asked = Llama.from_pretrained(folder, dtype="bfloat16")
    moved = Llama.from_pretrained(folder).float()
    unpinned.set(None)  # a CPU without bf16 dot products: float32 by default
    plain = Llama.from_pretrained(folder)
    assert (asked.dtype, moved.dtype, plain.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.batch_invariant = True
        model.batch_invariant = False  # once per model
        for quiet in (asked, moved, plain):
            quiet.batch_invariant = False


def test_the_command_says_the_default_and_how_to_change_it(unpinned, tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    assert dtype_choice(model) == ("bfloat16 by default here: this CPU has bf16 dot products (avx512_bf16), and the "
                                   "batch-invariant mode keeps it exact (--dtype float32 for float32)")
    unpinned.set(None)
    assert dtype_choice(Llama.from_pretrained(tiny_checkpoint("gqa"))).startswith(
        "float32 by default here: this CPU has no bf16 dot products (--dtype bfloat16 for bfloat16)")
    result = GenerationResult(tokens=[1, 2, 3, 4], steps=2)
    line = summary(Timed(result, 1.0), LookaheadConfig(), notes=Notes("bfloat16", plain_rate=2.0))
    assert line.endswith("4.0 tok/s (bfloat16; plain ~2 tok/s here)")


@pytest.mark.slow
def test_the_command_loads_the_default_model_in_bf16_where_the_cpu_has_it(unpinned, capsys, default_model_dir):
    code = main(["generate", "Name three colors.", "--cache-dir", str(default_model_dir.parent),
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and "(bfloat16, cpu, batch-invariant)" in err[1]
    assert err[2] == ("lookahead: bfloat16 by default here: this CPU has bf16 dot products (avx512_bf16), and the "
                      "batch-invariant mode keeps it exact (--dtype float32 for float32)")
    assert " tok/s (bfloat16; " in err[-1]
