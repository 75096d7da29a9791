"""The MoE decoder family (``d9d.models.moe``): config, presets and module."""

from ._config import MoEConfig as MoEConfig
from ._model import MoE as MoE
from ._model import MoEModelOutput as MoEModelOutput
from ._model import MoEState as MoEState
from ._step import make_train_step as make_train_step

__all__ = ["MoE", "MoEConfig", "MoEModelOutput", "MoEState", "make_train_step"]
