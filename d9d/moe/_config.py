"""``MoEConfig``: the shape, routing and load-balancing options of one MoE layer."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from ..errors import ConfigError

__all__ = ["MoEConfig"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_POSITIVE_INTS = ("dim", "n_experts", "top_k", "expert_dim", "n_group", "topk_group")
_NON_NEGATIVE_FLOATS = ("aux_loss_coef", "z_loss_coef", "bias_update_rate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One dropless mixture-of-experts layer: router, routed SwiGLU experts, shared experts.

    Validated when built, so a bad config fails before any tensor is allocated.

    Args:
        dim: Width of the tokens the layer reads and writes.
        n_experts: Routed experts ``E``.
        top_k: Experts per token (``1 <= top_k <= n_experts``).
        expert_dim: Hidden width of each routed SwiGLU expert.
        n_shared_experts: Shared experts every token goes through (default 0), fused into one
            SwiGLU MLP of hidden width ``n_shared_experts * shared_expert_dim``.
        shared_expert_dim: Hidden width of one shared expert; default ``expert_dim``.
        score_func: ``"softmax"`` over the experts (Switch, Mixtral, Qwen3) or an independent
            ``"sigmoid"`` per expert (DeepSeek-V3). Default ``"softmax"``.
        norm_topk: Divide each token's top-k weights by their sum. Default False.
        n_group: Expert groups of group-limited routing (DeepSeek-V3); ``n_experts`` must
            divide by it. Default 1 (no grouping).
        topk_group: Groups a token may pick experts from (``<= n_group``). Default 1.
        routed_scaling_factor: Multiplies the routed weights (DeepSeek-V3: 2.5). Default 1.
        aux_loss_coef: Weight of the Switch/GShard load-balancing loss. Default 0.
        z_loss_coef: Weight of the router z-loss (ST-MoE). Default 0.
        bias_update_rate: Step of the aux-loss-free bias update; > 0 gives the router an
            ``expert_bias`` param used for selection only. Default 0 (no bias).
        capacity_factor: None (default) is dropless; a number caps each expert at
            ``ceil(capacity_factor * T * top_k / E)`` of a call's ``T`` tokens and drops the
            later choices (weight 0), in token order.

    Raises:
        ConfigError: A size is not a positive int (``shared_expert_dim=0`` included), a
            coefficient or factor is not a finite number in its range, ``norm_topk`` is not a
            bool, ``top_k > n_experts``, the groups do not divide the experts or cannot hold
            ``top_k`` choices, or an unknown ``score_func``.

    Example:
        >>> cfg = MoEConfig(dim=16, n_experts=6, top_k=2, expert_dim=24)
        >>> cfg.shared_dim
        0
    """

    dim: int
    n_experts: int
    top_k: int
    expert_dim: int
    n_shared_experts: int = 0
    shared_expert_dim: int | None = None
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"MoEConfig.{name} must be a positive int, got {name}={value!r}.")
        for name in _NON_NEGATIVE_FLOATS:
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise ConfigError(
                    f"MoEConfig.{name} must be a finite number >= 0, got {name}={value!r}."
                )
        shared, shared_dim = self.n_shared_experts, self.shared_expert_dim
        if (
            not _is_int(shared)
            or shared < 0
            or not (shared_dim is None or (_is_int(shared_dim) and shared_dim > 0))
        ):
            # shared_expert_dim=0 is refused, not read as None (expert_dim): a falsy width
            # would otherwise build shared experts of another width than the one asked for.
            raise ConfigError(
                f"MoEConfig: n_shared_experts={shared!r} must be an int >= 0 and "
                f"shared_expert_dim={shared_dim!r} a positive int (or None: expert_dim)."
            )
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"MoEConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}: a token "
                f"picks distinct experts; use top_k <= {self.n_experts}."
            )
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(
                f"MoEConfig.score_func={self.score_func!r} is not 'softmax' or 'sigmoid'."
            )
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(
                f"MoEConfig: n_experts={self.n_experts} must divide into n_group={self.n_group} "
                f"groups and topk_group={self.topk_group} must be <= n_group."
            )
        if self.topk_group * (self.n_experts // self.n_group) < self.top_k:
            raise ConfigError(
                f"MoEConfig: topk_group={self.topk_group} groups of "
                f"{self.n_experts // self.n_group} experts hold fewer than top_k={self.top_k} "
                "experts; raise topk_group or lower top_k."
            )
        if self.capacity_factor is not None and not (
            _is_number(self.capacity_factor) and 0 < self.capacity_factor < math.inf
        ):
            raise ConfigError(
                f"MoEConfig.capacity_factor={self.capacity_factor!r} must be a finite number "
                "> 0, or None for dropless routing."
            )
        if not (
            _is_number(self.routed_scaling_factor) and 0 < self.routed_scaling_factor < math.inf
        ):
            raise ConfigError(
                f"MoEConfig.routed_scaling_factor={self.routed_scaling_factor!r} must be a "
                "finite number > 0 (1.0: unscaled; DeepSeek-V3 uses 2.5)."
            )
        if not isinstance(self.norm_topk, bool):
            raise ConfigError(f"MoEConfig.norm_topk={self.norm_topk!r} must be True or False.")

    @property
    def shared_dim(self) -> int:
        """Hidden width of the fused shared experts (0: none)."""
        return self.n_shared_experts * (self.shared_expert_dim or self.expert_dim)

    @property
    def num_params(self) -> int:
        """Params of the layer: router (and bias), routed and shared experts."""
        bias = self.n_experts if self.bias_update_rate > 0 else 0
        routed = 3 * self.n_experts * self.dim * self.expert_dim
        return self.n_experts * self.dim + bias + routed + 3 * self.dim * self.shared_dim

    @property
    def active_params(self) -> int:
        """Params one token uses: router, ``top_k`` routed experts and the shared ones."""
        per_token = 3 * self.top_k * self.dim * self.expert_dim
        return self.n_experts * self.dim + per_token + 3 * self.dim * self.shared_dim
