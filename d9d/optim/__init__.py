"""Optimizers as pure ``init``/``update`` pairs over param pytrees (``d9d.optim``), optax-shaped."""

from ._adam import ScaleByAdamState as ScaleByAdamState
from ._adam import scale_by_adam as scale_by_adam
from ._aliases import adam as adam
from ._aliases import adamw as adamw
from ._aliases import lion as lion
from ._aliases import sgd as sgd
from ._clipping import ClipByGlobalNormState as ClipByGlobalNormState
from ._clipping import clip_by_global_norm as clip_by_global_norm
from ._clipping import global_norm as global_norm
from ._inspect import get_state as get_state
from ._lion import ScaleByLionState as ScaleByLionState
from ._lion import scale_by_lion as scale_by_lion
from ._masking import Mask as Mask
from ._masking import MaskedState as MaskedState
from ._masking import masked as masked
from ._master_weights import MasterWeightsState as MasterWeightsState
from ._master_weights import master_weights as master_weights
from ._momentum import TraceState as TraceState
from ._momentum import trace as trace
from ._offloaded import OffloadedState as OffloadedState
from ._offloaded import offloaded as offloaded
from ._scaling import AddDecayedWeightsState as AddDecayedWeightsState
from ._scaling import ScaleByLearningRateState as ScaleByLearningRateState
from ._scaling import ScaleState as ScaleState
from ._scaling import add_decayed_weights as add_decayed_weights
from ._scaling import scale as scale
from ._scaling import scale_by_learning_rate as scale_by_learning_rate
from ._schedules import Schedule as Schedule
from ._schedules import constant as constant
from ._schedules import cosine_decay as cosine_decay
from ._schedules import linear_warmup as linear_warmup
from ._schedules import warmup_cosine as warmup_cosine
from ._stochastic_rounding import StochasticRoundState as StochasticRoundState
from ._stochastic_rounding import stochastic_round as stochastic_round
from ._stochastic_rounding import stochastic_round_to_bfloat16 as stochastic_round_to_bfloat16
from ._transform import GradientTransformation as GradientTransformation
from ._transform import apply_updates as apply_updates
from ._transform import chain as chain

__all__ = [
    "AddDecayedWeightsState",
    "ClipByGlobalNormState",
    "GradientTransformation",
    "Mask",
    "MaskedState",
    "MasterWeightsState",
    "OffloadedState",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "ScaleByLionState",
    "ScaleState",
    "Schedule",
    "StochasticRoundState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "get_state",
    "global_norm",
    "linear_warmup",
    "lion",
    "masked",
    "master_weights",
    "offloaded",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "sgd",
    "stochastic_round",
    "stochastic_round_to_bfloat16",
    "trace",
    "warmup_cosine",
]
