"""`Llama(fusion=...)`: the merged projections keep the Hugging Face names, and the fused forwards ("triton" under
the interpreter, "compile" with inductor on the CPU) give the torch forward's logits and plain greedy's tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import needs_interpreter, save_tiny_checkpoint
from lookahead import LookaheadConfig
from lookahead.backends import choose_fusion
from lookahead.kernels import StepPattern
from lookahead.models import Llama
from lookahead.models.runner import CachedRunner

FAMILIES = {"gqa": dict(), "bias": dict(attention_bias=True, mlp_bias=True), "odd": dict(hidden_size=72, head_dim=12,
                                                                                         intermediate_size=100)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3")  # per-head q/k norms


@needs_interpreter
@pytest.mark.parametrize("variant", [*FAMILIES, "qwen3"])
def test_triton_fusion_gives_the_torch_logits(tiny_checkpoint, qwen3, variant):
    folder = qwen3 if variant == "qwen3" else tiny_checkpoint(variant, **FAMILIES[variant])
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(0))
    reference = Llama.from_pretrained(folder, fusion="none")
    fused = Llama.from_pretrained(folder, fusion="triton", attn_backend="triton")
    assert reference.fusion == "none" and fused.fusion == "triton"
    expected = reference(ids)
    assert (fused(ids) - expected).abs().max().item() < 2e-5
    # per-row positions and a subset of rows, as a batch step passes them
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], list(range(40, 51))])
    rows = torch.tensor([[0, 10], [3, 4]])
    want = reference(ids, positions, lambda layer, q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), rows)
    got = fused(ids, positions, lambda layer, q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), rows)
    assert (got - want).abs().max().item() < 2e-5


@needs_interpreter
def test_merged_projections_keep_the_hugging_face_names(tiny_checkpoint):
    folder = tiny_checkpoint("tied", tie_word_embeddings=True)
    model = Llama.from_pretrained(folder, fusion="triton", attn_backend="triton")
    plain = Llama.from_pretrained(folder, fusion="none")
    assert list(model.state_dict()) == list(plain.state_dict())
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for dtype in (torch.float16, torch.float32):  # a cast gives every parameter a new tensor: merged again
        model.to(dtype)
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        for module, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            storage = module.merged_weight.untyped_storage().data_ptr()
            assert all(getattr(module, n).weight.untyped_storage().data_ptr() == storage for n in names)
            assert module.merged_weight.dtype == dtype
        assert torch.equal(attn.merged_weight[: attn.q_proj.out_features], attn.q_proj.weight)
    with torch.no_grad():  # a write through an HF-named parameter is a write into the merged GEMM's weight
        model.model.layers[0].mlp.up_proj.weight.zero_()
    assert not model.model.layers[0].mlp.merged_weight[96:].any()


def test_fusion_is_chosen_and_checked():
    assert choose_fusion("auto", "cuda", "triton") == "triton"
    assert choose_fusion("auto", "cuda", "torch") == "none"
    assert choose_fusion("auto", "cpu", "torch") == "none"
    assert choose_fusion("compile", "cpu", "torch") == "compile"
    with pytest.raises(ValueError, match="needs Triton's interpreter"):
        choose_fusion("triton", "cpu", "torch", interpreting=False)
    with pytest.raises(ValueError, match="fusion must be one of auto, none, triton, compile; got 'fused'"):
        choose_fusion("fused", "cpu", "torch")


def test_fusion_argument_errors(tiny_checkpoint):
    with pytest.raises(ValueError, match="fusion must be one of"):
        Llama.from_pretrained(tiny_checkpoint("gqa"), fusion="yes")
    with pytest.raises(ValueError, match="'auto' is resolved by from_pretrained"):
        Llama(Llama.from_pretrained(tiny_checkpoint("gqa")).config, fusion="auto")


@needs_interpreter
def test_fused_lookahead_decoding_equals_plain_greedy(tiny_checkpoint):
    """Tree steps of a ragged batch and of one prompt with the fused kernels and the Triton attention (interpreter):
    plain greedy's tokens, token for token."""
    folder = tiny_checkpoint("gqa")
    reference = Llama.from_pretrained(folder, fusion="none")
    fused = Llama.from_pretrained(folder, fusion="triton", attn_backend="triton")
    prompts = [[3, 17, 22, 3, 17, 5, 9, 3, 17], [8, 1]]
    expected = [reference.generate(p, max_new_tokens=10, eos_token_id=[]).tokens for p in prompts]
    tree = LookaheadConfig(2, 3, 3, form="tree", budget="fixed")
    batch = fused.generate(prompts, max_new_tokens=10, eos_token_id=[], lookahead=tree)
    assert [r.tokens for r in batch] == expected
    alone = fused.generate(prompts[0], max_new_tokens=10, eos_token_id=[], lookahead=tree, static_step=True)
    assert alone.tokens == expected[0] and alone.steps < 10


def test_compiled_step_gives_the_eager_step(tiny_checkpoint):
    """fusion "compile": a runner's step runs the forward through torch.compile (inductor, CPU), same logits."""
    folder = tiny_checkpoint("one-layer", num_hidden_layers=1)
    pattern = StepPattern(2, 3, 1)
    tokens = [5, 9, 13, 2, 7, 11]
    out = {}
    for fusion in ("none", "compile"):
        model = Llama.from_pretrained(folder, fusion=fusion)
        runner = CachedRunner(model, 4, max_step_tokens=pattern.num_tokens).sequence(32)
        runner.prefill([3, 17, 22, 3])
        out[fusion] = runner.step(tokens, pattern, [0, 4, 5]).logits
        if fusion == "compile":
            assert model._compiled_forward is not None
    assert (out["compile"] - out["none"]).abs().max().item() < 1e-4


def test_a_conversion_that_changes_nothing_keeps_the_merged_weights(tiny_checkpoint):
    """Captured CUDA graphs read the merged tensors: `.to()` to where the model already is must not move them."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"), fusion="none")
    attn = model.model.layers[0].self_attn
    before = attn.merged_weight.data_ptr()
    model.to("cpu").float().requires_grad_(False)
    assert attn.merged_weight.data_ptr() == before == attn.q_proj.weight.data_ptr()
    model.to(torch.float16)  # a real conversion merges anew, the parameters still its rows
    assert attn.merged_weight.dtype == torch.float16
    assert attn.k_proj.weight.data_ptr() == attn.merged_weight[attn.q_proj.weight.shape[0]].data_ptr()


def test_replaced_parameters_reach_the_merged_forward_and_drop_the_runner(tiny_checkpoint):
    """load_state_dict(assign=True) gives the parameters new tensors: the merged GEMMs must read them, and a runner
    (whose graphs read the old ones) is rebuilt."""
    a = Llama.from_pretrained(tiny_checkpoint("gqa"), fusion="compile")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    a.generate([1, 2, 3], max_new_tokens=2)
    runner = a.runner
    other = Llama.from_pretrained(tiny_checkpoint("gqa", seed=7), fusion="none")
    a.load_state_dict(other.state_dict(), assign=True)
    assert torch.allclose(a(ids), other(ids), atol=1e-6)  # the eager merged forward, with the new weights
    assert a.generate([1, 2, 3], max_new_tokens=6).tokens == other.generate([1, 2, 3], max_new_tokens=6).tokens
    assert a.runner is not runner
    assert not a.merge_weights()


def test_the_compiled_step_may_meet_more_shapes_than_dynamos_default(monkeypatch):
    """Self-tuned sizes and shrinking batches meet many step shapes; with fullgraph=True torch fails past its
    recompile limit (8 by default), so the compiled step raises it for its calls."""
    from lookahead.models import llama

    model = Llama.__new__(Llama)
    torch.nn.Module.__init__(model)
    model.fusion = "compile"
    seen = []
    model._compiled_forward = lambda *args: seen.append(torch._dynamo.config.recompile_limit)
    model.step_forward(None, None, None, None)
    assert seen == [llama.COMPILED_SHAPES] and llama.COMPILED_SHAPES > 8 and torch._dynamo.config.recompile_limit == 8
