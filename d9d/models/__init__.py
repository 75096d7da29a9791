"""Reference models written for d9d: plain ``nn.Module``s that declare their logical axes."""

from .llama import Llama as Llama
from .llama import LlamaConfig as LlamaConfig
from .moe import MoE as MoE
from .moe import MoEConfig as MoEConfig
from .moe import MoEModelOutput as MoEModelOutput

__all__ = ["Llama", "LlamaConfig", "MoE", "MoEConfig", "MoEModelOutput"]
