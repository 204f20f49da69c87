"""Installs the three top-level folders as `lookahead` (with its sub-packages), `lookahead.kernels` and
`lookahead.models`, and the `lookahead` command."""

from setuptools import setup

ROOMS = ("loop", "drafts", "parallel", "hf", "cli")  # lookahead's sub-packages
TRITON = "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'"

setup(
    name="lookahead",
    version="0.1.0",
    description="Exact lookahead decoding for LLaMA-family models, with Triton attention kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["lookahead", *(f"lookahead.{room}" for room in ROOMS), "lookahead.kernels", "lookahead.models"],
    package_dir={"lookahead": "lookahead", "lookahead.kernels": "kernels", "lookahead.models": "models"},
    install_requires=[
        "torch>=2.4",  # CUDA builds of torch bring triton with them; the CPU path never runs it
        "safetensors>=0.4",
        "transformers>=4.45",  # tokenizers and chat templates only; models run without it
        "gguf>=0.10",  # reads the embedded default model's GGUF file once, to convert it
        "numpy",
        "tqdm",
    ],
    extras_require={
        "triton": [TRITON],  # the kernel on a CPU-only torch, under TRITON_INTERPRET=1
        "test": ["pytest>=8", "accelerate", "pytest-benchmark", TRITON],  # kernel tests run under the interpreter
        "bench": ["pytest-benchmark>=4", "matplotlib", TRITON],
    },
    entry_points={"console_scripts": ["lookahead=lookahead.cli:main"]},
)
