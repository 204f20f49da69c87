"""A minimal LLaMA on safetensors weights, its KV cache, `Llama.generate`, and the default model's folder."""

from .config import ConfigError, LlamaConfig
from .default_model import default_model_dir
from .llama import Llama
from .loading import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "Llama", "LlamaConfig", "default_model_dir"]
