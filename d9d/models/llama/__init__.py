"""The Llama decoder family (``d9d.models.llama``): config, presets and module."""

from ._config import LlamaConfig as LlamaConfig
from ._model import Llama as Llama

__all__ = ["Llama", "LlamaConfig"]
