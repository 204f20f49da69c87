"""Installs the three top-level folders as `lookahead` (with its sub-packages), `lookahead.kernels` and
`lookahead.models`, and the `lookahead` command."""

import ast
from pathlib import Path

from setuptools import find_packages, setup

# the folder of each package, from its one home, lookahead/folders.py (parsed, not imported: the package's
# dependencies may not be installed yet)
FOLDERS = next(ast.literal_eval(node.value)
               for node in ast.parse((Path(__file__).parent / "lookahead" / "folders.py").read_text()).body
               if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS")
# every package under the three folders, found rather than listed: a listed one left out (lookahead.tuning once)
# is missing from the wheel, which an editable install never shows
PACKAGES = [f"{name}.{sub}".rstrip(".") for name, folder in FOLDERS.items() for sub in ["", *find_packages(folder)]]
TRITON = "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'"
# lookahead serve; llguidance compiles structured outputs' grammars (docs/DESIGN.md, "Structured outputs")
SERVE = ["fastapi>=0.110", "uvicorn>=0.30", "prometheus-client>=0.20", "llguidance>=1.0"]

setup(
    name="lookahead",
    version="0.1.0",
    description="Exact lookahead decoding for LLaMA-family models, with Triton attention kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=FOLDERS,
    package_data={"lookahead": ["csrc/*.cpp"], "lookahead.kernels": ["csrc/*.cpp"]},  # C++ compiled on first use
    install_requires=[
        "torch>=2.4",  # CUDA builds of torch bring triton with them; the CPU path never runs it
        "safetensors>=0.4",
        # tokenizers, chat templates and lookahead.hf (whose MIN_TRANSFORMERS is this bound); models run without it.
        # Tested from this bound (.ci/transformers-lowest) to the newest pip resolves (.ci/run)
        "transformers>=5.0",
        "gguf>=0.10",  # reads the embedded default model's GGUF file once, to convert it
        "numpy",
        "tqdm",
        "ninja",  # builds the batch-invariant mode's CPU GEMM (lookahead.kernels.cpu_kernels)
    ],
    extras_require={
        "triton": [TRITON],  # the kernel on a CPU-only torch, under TRITON_INTERPRET=1
        "serve": SERVE,
        # kernel tests run under the interpreter; the server's tests talk to it with the openai client and LangChain
        # pytest-xdist: the suite in two worker processes (README's test command)
        "test": ["pytest>=8", "pytest-xdist>=3", "accelerate", "pytest-benchmark", TRITON, *SERVE, "openai>=1.40",
                 "langchain-openai>=0.3"],
        "bench": ["pytest-benchmark>=4", "matplotlib", TRITON],
    },
    entry_points={"console_scripts": ["lookahead=lookahead.cli:main"]},
)
