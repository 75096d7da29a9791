"""Mixture of experts (``d9d.moe``): a dropless MoE layer, its routing, and load balancing.

See ``docs/moe.md``.
"""

from ._balance import load_balance as load_balance
from ._balance import update_router_bias as update_router_bias
from ._config import MoEConfig as MoEConfig
from ._layer import Experts as Experts
from ._layer import MoE as MoE
from ._layer import MoEOutput as MoEOutput
from ._routing import Routing as Routing
from ._routing import route as route

__all__ = [
    "Experts",
    "MoE",
    "MoEConfig",
    "MoEOutput",
    "Routing",
    "load_balance",
    "route",
    "update_router_bias",
]
