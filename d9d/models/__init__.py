"""Reference models written for d9d: plain ``nn.Module``s that declare their logical axes."""

from .llama import Llama as Llama
from .llama import LlamaConfig as LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
