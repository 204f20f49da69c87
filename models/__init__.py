"""A minimal LLaMA on safetensors weights, its KV cache, and `Llama.generate`."""

from .config import ConfigError, LlamaConfig
from .llama import Llama
from .loading import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "Llama", "LlamaConfig"]
