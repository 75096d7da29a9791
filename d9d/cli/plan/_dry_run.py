"""One training step run on the meta device of a simulated world, to count what it moves and
measure what its forward keeps for the backward.

Every tensor is a meta tensor and every collective returns at once (``fake_world``), so a
step of an 8B model on 1024 simulated ranks runs in seconds with no memory: shapes, DTensor
placements and the collectives they issue are real, values are not. The few values the step
reads back to Python read as ordinary data would: every check passes (the loss's check
of out-of-vocab labels finds none; ``transformers``' check for packed sequences finds every
position in order, as the real batch's ``all()`` does). A pipeline step runs its schedule
too: its sends and receives between stages complete at once, and the pipeline supplies what
peers would have told it (``transforms/pipeline/_stage_shapes.py``).

The bytes kept are measured as ``d9d.testing.KeptBytes`` measures a real run (meta tensors
have real sizes), with the kernels CPU would run (:func:`meta_as_cpu`).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ...core._comm_count import CollectiveCounter, CommStats
from ...core._context import running
from ...core._step import TransformedStep
from ...errors import DryRunError
from ...testing import KeptBytes
from ._meta_kernels import MetaKernelCache

__all__ = ["DryRun", "count_collectives", "dry_run", "group_labels", "meta_as_cpu"]


@contextlib.contextmanager
def meta_as_cpu() -> Iterator[None]:
    """Runs meta tensors through what CPU would run: a meta scalar read back to Python reads
    as ordinary data would (:class:`_MetaScalars`) instead of raising, and
    ``F.scaled_dot_product_attention`` takes the kernel CPU takes (:func:`_cpu_attention`),
    in the forward and in a recomputation alike."""
    # Meta's choice of SDPA kernel is made inside the op, from the device (always the math
    # one, which keeps the attention matrix for the backward where CPU's flash kernel keeps a
    # log-sum-exp), and no mode sees it: so the op's autograd kernel for meta is replaced
    # while the step runs (a dispatch-level override, so remat's recomputation in the
    # backward takes it too, where a TorchFunctionMode is not in force).
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _cpu_attention, "AutogradMeta")
    try:
        with _MetaScalars():
            yield
    finally:
        library._destroy()


class _MetaScalars(TorchDispatchMode):
    """Reads a meta scalar as ordinary data would read, so that every check passes: the
    result of an ``all()`` reads True, any other boolean False (``any()`` of what would be an
    error), a number 0; and gives ``_embedding_bag``'s outputs CPU's shapes
    (:func:`_cpu_embedding_bag`)."""

    def __init__(self) -> None:
        super().__init__()
        self._alls = WeakIdKeyDictionary()  # the results of all(), by identity

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            if args[0].dtype == torch.bool:
                return args[0] in self._alls
            return 0
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.all and isinstance(out, torch.Tensor):
            self._alls[out] = True
        if func is torch.ops.aten._embedding_bag.default and args[0].is_meta:
            return _cpu_embedding_bag(out, *args, **(kwargs or {}))
        return out


def _cpu_embedding_bag(
    out: tuple[torch.Tensor, ...],
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[torch.Tensor, ...]:
    """``_embedding_bag``'s four outputs (the bags, offset2bag, bag sizes, max indices), the
    last three kept for its backward, shaped as CPU's kernel makes them: meta's kernel (as
    CUDA's) makes offset2bag one per index and max indices empty outside ``max`` mode; CPU's
    makes max indices one per bag, and offset2bag empty on its fast path for sums (float32,
    float16 or bfloat16 weights with unit stride along a row, no padding index). Measured on
    torch 2.13 (``moe_unpermute``'s ``torch`` backend is one ``embedding_bag``)."""
    del indices, offsets, scale_grad_by_freq, sparse, per_sample_weights, include_last_offset
    if mode == 2:  # max: both keep their per-index and per-bag tensors
        return out
    bags, offset2bag, sizes, _ = out
    fast = (
        mode == 0
        and padding_idx < 0
        and weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and weight.stride(-1) == 1
    )
    if fast:
        offset2bag = offset2bag.new_empty(0)
    return bags, offset2bag, sizes, sizes.new_empty(sizes.shape)


def _cpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA of meta tensors on the kernel CPU would choose for them: the choice is asked of
    CPU stand-ins of the same shapes, and the flash kernel called as CPU's
    ``scaled_dot_product_attention`` calls it (a boolean mask made float first)."""
    options = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    choice = torch._fused_sdp_choice(
        *(_on_cpu(t) for t in (query, key, value)),
        attn_mask=None if attn_mask is None else _on_cpu(attn_mask),
        enable_gqa=enable_gqa,
        **options,
    )
    if choice != SDPBackend.FLASH_ATTENTION.value:
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, enable_gqa=enable_gqa, **options
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        low = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, zero, low)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``tensor``'s shape, dtype and last-dim stride (what SDPA's choice
    reads), every other dim a broadcast of one row: no memory however large the shape."""
    if tensor.dim() == 0:
        return torch.empty((), dtype=tensor.dtype)
    step = tensor.stride()[-1]
    row = torch.empty(max(tensor.shape[-1] - 1, 0) * step + 1, dtype=tensor.dtype)
    return row.as_strided(tensor.shape, (0,) * (tensor.dim() - 1) + (step,))


def group_labels(step: TransformedStep) -> dict[str, str]:
    """The mesh axis of every process group ``step`` runs collectives on, by group name:
    its mesh's and its runtimes' own (a tied param's pair of stages)."""
    mesh = step.mesh
    labels = {mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names or ()}
    for runtime in step.runtimes:
        labels.update(runtime.group_labels())
    return labels


@dataclass(frozen=True)
class DryRun:
    """What one step run on meta showed on this rank.

    Attributes:
        comms: Its collectives per kind and mesh axis (None: the step did not finish).
        kept: Bytes the forward kept for the backward: op outputs alive when the first
            backward op ran (``KeptBytes.before_backward``), params, optimizer state and
            batch excluded (None: no backward began).
        error: Why the step did not finish on meta, or None.
    """

    comms: CommStats | None
    kept: int | None
    error: DryRunError | None = None


def dry_run(
    step: TransformedStep,
    params: Any,
    opt_state: Any,
    batch: dict[str, torch.Tensor],
    *,
    known: Mapping[str, str] | None = None,
) -> DryRun:
    """One call of ``step`` on meta tensors: the collectives it issues on this rank, as
    ``step.comms`` counts them (the batch check across ranks, which needs real values, is
    left out: it runs once, not every step), and the bytes its forward keeps for the
    backward, as ``KeptBytes`` measures them on a real run. A ``DryRunError`` (the step
    cannot run on meta) is returned, with the bytes kept if its backward had begun; any
    other error is raised (a layout a real step refuses too).

    ``known``: axes of the groups of steps built before this one on meshes of the same
    layout. DTensor caches sharding decisions by mesh layout, not identity, so an op of
    this step can hand back a DTensor on an earlier step's equal mesh, whose collectives
    then run on that mesh's groups (``d9d plan`` builds up to three steps)."""
    labels = {**(known or {}), **group_labels(step)}
    counter = CollectiveCounter(step.mesh, labels)
    kept = KeptBytes((params, opt_state, batch))
    try:
        with _frozen(), MetaKernelCache(), counter, kept, meta_as_cpu(), running(step.context()):
            step.run(params, opt_state, batch)
    except DryRunError as error:
        return DryRun(None, kept.before_backward, error)
    return DryRun(counter.stats, kept.before_backward)


@contextlib.contextmanager
def _frozen() -> Iterator[None]:
    """The objects that exist now left out of the garbage collections inside (``gc.freeze``).

    ``KeptBytes`` collects garbage before it counts, and a full collection took 0.3 s with
    transformers loaded (470,000 objects); what existed before the step holds none of its
    outputs but live ones, so the collection need not scan it. The dry run owns the process
    (``fake_world``), so no other thread measures meanwhile. Left alone if someone else froze
    objects."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def count_collectives(
    step: TransformedStep,
    params: Any,
    opt_state: Any,
    batch: dict[str, torch.Tensor],
    *,
    known: Mapping[str, str] | None = None,
) -> CommStats:
    """The collectives of :func:`dry_run`.

    Raises:
        DryRunError: The step cannot run on meta (its message says why).
    """
    run = dry_run(step, params, opt_state, batch, known=known)
    if run.error is not None:
        raise run.error
    return run.comms
