"""``MoE``: a dropless mixture-of-experts layer on the ``d9d.kernels`` MoE ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import grouped_gemm, moe_permute, moe_unpermute, swiglu
from ._balance import balance_losses, check_loads_in_mesh, global_load, sequence_sum
from ._config import MoEConfig
from ._routing import route

__all__ = ["MoE", "MoEOutput"]

_Device = torch.device | str | None


class MoEOutput(NamedTuple):
    """What one call of :class:`MoE` returns."""

    out: Tensor  # the layer's output, shaped and typed like its input
    aux_loss: Tensor  # 0-d float32: weighted Switch aux loss + z-loss, to add to the loss
    load: Tensor  # [E] float32: choices per expert, summed over the data-parallel ranks


class Router(nn.Module):
    """``weight [E, dim]`` (logits ``x @ weight.T``) and, for aux-loss-free balancing, an
    ``expert_bias [E]`` used for selection only (zero gradient)."""

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.dim, device=device))
        if config.bias_update_rate > 0:
            bias = torch.zeros(config.n_experts, device=device)
            self.expert_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.expert_bias = None


class Experts(nn.Module):
    """``E`` SwiGLU experts as stacked weights ``w_gate``/``w_up`` ``[E, dim, hidden]`` and
    ``w_down`` ``[E, hidden, dim]``, the ``[E, K, N]`` layout of ``grouped_gemm``.

    Its three matmuls call :attr:`gemm`, ``d9d.kernels.grouped_gemm`` unless a transform
    sets another for one call (``d9d.fp8`` sets its fp8 grouped GEMM there).
    """

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        shape = (config.n_experts, config.dim, config.expert_dim)
        self.w_gate = nn.Parameter(torch.empty(shape, device=device))
        self.w_up = nn.Parameter(torch.empty(shape, device=device))
        self.w_down = nn.Parameter(torch.empty(shape[0], shape[2], shape[1], device=device))
        # gemm(x [T, K], w [E, K, N], group_sizes [E]) -> [T, N]
        self.gemm: Callable[[Tensor, Tensor, Tensor], Tensor] = grouped_gemm

    def forward(self, x: Tensor, group_sizes: Tensor) -> Tensor:
        """Rows of ``x`` grouped by expert (``group_sizes [E]``) through their experts."""
        gemm = self.gemm
        hidden = swiglu(gemm(x, self.w_gate, group_sizes), gemm(x, self.w_up, group_sizes))
        return gemm(hidden, self.w_down, group_sizes)


class SharedExperts(nn.Module):
    """The shared experts, fused into one SwiGLU MLP of bias-free linears."""

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.w_gate = nn.Linear(config.dim, config.shared_dim, bias=False, device=device)
        self.w_up = nn.Linear(config.dim, config.shared_dim, bias=False, device=device)
        self.w_down = nn.Linear(config.shared_dim, config.dim, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class MoE(nn.Module):
    """A dropless MoE layer: top-k router, routed SwiGLU experts, optional shared experts.

    Each token goes to its ``top_k`` experts (see :func:`d9d.moe.route` for the options); the
    routed experts run as three ``grouped_gemm`` over the tokens ``moe_permute`` grouped by
    expert, and ``moe_unpermute`` sums their outputs back with the routing weights. Shared
    experts see every token. No host sync: shapes never depend on the routing, so
    ``torch.compile`` traces one graph for any routing.

    Params (paths relative to the layer): ``router.weight [E, dim]``, ``router.expert_bias
    [E]`` (with ``bias_update_rate > 0``), ``experts.w_gate``/``experts.w_up [E, dim,
    expert_dim]``, ``experts.w_down [E, expert_dim, dim]``, ``shared.w_{gate,up,down}.weight``
    (with shared experts). :attr:`logical_axes` names their dims: ``experts``,
    ``expert_mlp`` and ``embed`` for the router and routed experts (``tensor_parallel``
    replicates the first two), ``mlp`` and ``embed`` for the shared experts (sharded by
    ``tensor_parallel`` like a dense MLP; ``expert_mlp`` in a capped layer).

    A dropless layer (``capacity_factor=None``) is *position-wise* (:attr:`position_wise`):
    each token's output depends on that token only, given the global loads, which the layer
    sums over the ranks of the step context's ``sequence_groups`` itself. So
    ``tensor_parallel``'s sequence parallelism runs it on each rank's part of the sequence.

    The forward never mutates the bias: it returns the global expert load, and the training
    step updates the bias functionally with :func:`d9d.moe.update_router_bias`.

    Args:
        config: The layer's options.
        device: Where params are created. They are left uninitialized on the meta device;
            otherwise :meth:`init_weights` runs.

    Example:
        >>> layer = MoE(MoEConfig(dim=8, n_experts=5, top_k=2, expert_dim=12, aux_loss_coef=0.01))
        >>> out = layer(torch.randn(2, 7, 8))
        >>> out.out.shape, out.load.sum().item()
        (torch.Size([2, 7, 8]), 28.0)
    """

    _routed_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {
        r"^router\.weight$": ("experts", "embed"),
        r"^router\.expert_bias$": ("experts",),
        r"^experts\.w_(gate|up)$": ("experts", "embed", "expert_mlp"),
        r"^experts\.w_down$": ("experts", "expert_mlp", "embed"),
    }

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.config = config
        # A capacity caps each expert per call in token order: the tokens of one call compete.
        self.position_wise = config.capacity_factor is None
        self.router = Router(config, device=device)
        self.experts = Experts(config, device=device)
        self.shared = SharedExperts(config, device=device) if config.shared_dim else None
        # token_dispatch(x [T, dim], expert_ids [T, k], weights [T, k]) -> [T, dim] in place
        # of :meth:`dispatch` when set (d9d.expert_parallel sets it for a call): an attribute
        # set and set back, which d9d.jit traces, where an override of the method would have
        # to be deleted again (Dynamo replays that deletion on a layer that never held it).
        self.token_dispatch: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
        if self.router.weight.device.type != "meta":
            self.init_weights()

    @property
    def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The params' logical axes. The shared experts' hidden dim is ``mlp`` (sharded by
        ``tensor_parallel`` like a dense MLP's) in a position-wise layer; in a capped one, which
        ``tensor_parallel`` runs whole beside its whole router, it is ``expert_mlp`` (whole too:
        a sharded linear there would have the layer's input grad summed over the axis)."""
        hidden = "mlp" if self.position_wise else "expert_mlp"
        return {
            **self._routed_axes,
            r"^shared\.w_(gate|up)\.weight$": (hidden, "embed"),
            r"^shared\.w_down\.weight$": ("embed", hidden),
        }

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, ``std``) weights, a zero bias; drawn on the CPU from ``generator``."""
        for name, param in self.named_parameters():
            if name == "router.expert_bias":
                param.zero_()
                continue
            values = torch.empty(param.shape, dtype=torch.float32)
            param.copy_(values.normal_(0.0, std, generator=generator))

    def dispatch(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """The routed experts' weighted output ``[T, dim]`` for tokens ``x [T, dim]``.

        On this rank: permute, grouped experts, unpermute. The forward calls
        :attr:`token_dispatch` in its place when set (``d9d.expert_parallel``'s all-to-all
        dispatch and combine).
        """
        n_experts = self.config.n_experts
        permuted, group_sizes, row_map = moe_permute(x, expert_ids, n_experts)
        return moe_unpermute(self.experts(permuted, group_sizes), row_map, weights)

    def forward(self, x: Tensor) -> MoEOutput:
        """Route the tokens of ``x [..., dim]`` and mix their experts' outputs.

        Returns:
            :class:`MoEOutput`: ``out`` shaped like ``x``, the 0-d ``aux_loss`` (0 when both
            coefficients are 0) and the global ``load [E]``.
        """
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat, self.router.weight)
        routing = route(logits, self.config, self.router.expert_bias)
        check_loads_in_mesh(self.config)
        load, tokens, ranks = global_load(routing.expert_ids, self.config.n_experts)
        aux_loss = balance_losses(logits, routing, load, tokens, ranks, self.config)
        dispatch = self.dispatch if self.token_dispatch is None else self.token_dispatch
        out = dispatch(flat, routing.expert_ids, routing.weights).view_as(x)
        if self.shared is not None:
            out = out + self.shared(x)  # x, not flat: tensor_parallel gathers its sequence dim
        return MoEOutput(out, sequence_sum(aux_loss), load)
