"""A quick check that an install works: `python -m pytest -m smoke` (seconds; no default model, no download).

The packages import, a tiny random LLaMA decodes with lookahead exactly as plain greedy, one small kernel case
matches its PyTorch reference (under Triton's interpreter on a CPU), and the `lookahead` command answers. The
full suite, `python -m pytest`, stays the test command; these are its fastest witnesses that the pieces are
installed and wired together.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import needs_triton

pytestmark = pytest.mark.smoke


def test_packages_import():
    import lookahead
    import lookahead.hf
    import lookahead.kernels
    import lookahead.models

    assert callable(lookahead.kernels.lookahead_attention) and callable(lookahead.hf.custom_generate)
    assert lookahead.models.Llama.generate and lookahead.LookaheadConfig()


@pytest.mark.parametrize("form", ["tree", "chains"])
def test_tiny_model_lookahead_equals_plain_greedy(tiny_checkpoint, form):
    from helpers import flat_cost
    from lookahead import LookaheadConfig
    from lookahead.models import Llama

    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.cost_model = flat_cost()  # self-tuned steps that take the whole draft, whatever the machine's load
    prompt = [3, 17, 22, 3, 17, 5, 9, 3, 17]
    plain = model.generate(prompt, max_new_tokens=32, eos_token_id=[])
    result = model.generate(prompt, max_new_tokens=32, eos_token_id=[], lookahead=LookaheadConfig(form=form))
    assert result.tokens == plain.tokens
    assert result.steps < plain.steps  # a random tiny model repeats itself: some steps accept several tokens


@needs_triton
def test_kernel_matches_reference():
    pytest.importorskip("triton")
    from lookahead.kernels import lookahead_attention, reference_attention

    W, N, G, L = 2, 3, 2, 37  # conftest sets TRITON_INTERPRET=1 where there is no GPU
    T = (W + G) * (N - 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 32, generator=generator).to(device)
    k, v = torch.randn(2, 1, 2, L + T, 32, generator=generator).to(device)
    out = lookahead_attention(q, k, v, L, W, N, G)
    ref = reference_attention(q, k, v, L, W, N, G, upcast=True)
    eager = reference_attention(q, k, v, L, W, N, G, upcast=False)
    assert (out - ref).abs().max().item() <= 2 * (eager - ref).abs().max().item() + 1e-4  # FlagAttention's rule


def test_command_answers():
    script = Path(sys.executable).with_name("lookahead")  # what `pip install -e .` puts beside python
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "lookahead"]
    run = subprocess.run([*command, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--no-lookahead" in run.stdout
