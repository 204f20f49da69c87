"""A minimal LLaMA on safetensors weights, its paged KV cache, `Llama.generate`, `engine_for` (a model behind an engine
of its own, for serving), and the default model's folder."""

from .config import ConfigError, LlamaConfig
from .default_model import default_model_dir
from .llama import Llama
from .loading import CheckpointError
from .serving import engine_for

__all__ = ["CheckpointError", "ConfigError", "Llama", "LlamaConfig", "default_model_dir", "engine_for"]
