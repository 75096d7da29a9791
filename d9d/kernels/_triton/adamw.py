"""AdamW over many tensors in one Triton launch: read p, g, m, v once, write p, m, v once.

A program updates one block of one tensor. Which tensor and which block it takes comes from
two small tables built from the tensors' sizes (cached: a training run passes the same
sizes every step), and where that tensor lies from a table of its four addresses, loaded
as an integer and cast to a pointer. Tensors on one device whose four dtypes agree share a
launch, so a model of bfloat16 params with float32 moments is one launch, not one per param
(the per-tensor launch measured 0.85x ``torch.compile`` on one Llama-3 8B decoder layer, H100).

``lr`` and the bias corrections are read from 0-d device tensors, so a schedule's value
changes without a recompile or a host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, num_warps

__all__ = ["update_"]

_BLOCK = 65536 if INTERPRETING else 1024


@triton.jit
def _kernel(
    ADDRESSES,
    NUMELS,
    BLOCK_TENSOR,
    BLOCK_INDEX,
    P0,
    G0,
    M0,
    V0,
    LR,
    STEP_SIZE,
    BIAS_CORRECTION2_SQRT,
    n_tensors,
    beta1,
    beta2,
    eps,
    weight_decay,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    tensor = tl.load(BLOCK_TENSOR + program)
    offsets = tl.load(BLOCK_INDEX + program).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < tl.load(NUMELS + tensor)
    # ADDRESSES is [4, n_tensors]: the rows are p, g, m and v; P0..V0 give their dtypes.
    p_ptr = tl.load(ADDRESSES + tensor).to(tl.pointer_type(P0.dtype.element_ty))
    g_ptr = tl.load(ADDRESSES + n_tensors + tensor).to(tl.pointer_type(G0.dtype.element_ty))
    m_ptr = tl.load(ADDRESSES + 2 * n_tensors + tensor).to(tl.pointer_type(M0.dtype.element_ty))
    v_ptr = tl.load(ADDRESSES + 3 * n_tensors + tensor).to(tl.pointer_type(V0.dtype.element_ty))
    lr = tl.load(LR)
    step_size = tl.load(STEP_SIZE)
    bias_correction2_sqrt = tl.load(BIAS_CORRECTION2_SQRT)
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    p = p * (1.0 - lr * weight_decay)
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(p_ptr + offsets, p.to(P0.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offsets, m.to(M0.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(V0.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _block_tables(device: torch.device, numels: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``(numels, tensor of each block, index of each block within its tensor)`` on ``device``."""
    blocks = torch.tensor([triton.cdiv(n, _BLOCK) for n in numels])
    block_tensor = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_index = torch.arange(len(block_tensor)) - first_block[block_tensor]
    tables = (torch.tensor(numels), block_tensor.int(), block_index.int())
    return tuple(t.to(device) for t in tables)


def _launch(
    tensors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    scalars: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    hyper: tuple[float, float, float, float],
) -> None:
    """One launch updating every ``(p, g, m, v)`` of ``tensors`` (contiguous, dtypes alike)."""
    device = tensors[0][0].device
    numels, block_tensor, block_index = _block_tables(device, tuple(t[0].numel() for t in tensors))
    addresses = torch.tensor([[t[i].data_ptr() for t in tensors] for i in range(4)])
    _kernel[(len(block_tensor),)](
        addresses.to(device),
        numels,
        block_tensor,
        block_index,
        *tensors[0],
        *scalars,
        len(tensors),
        *hyper,
        BLOCK=_BLOCK,
        num_warps=num_warps(_BLOCK),
    )


def update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: torch.Tensor,
    step: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Updates ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place (via copies if strided)."""
    if not params:
        return
    # One launch per device and dtypes: the kernel dereferences every address on one device.
    groups: dict[tuple[torch.device, tuple[torch.dtype, ...]], list[tuple[torch.Tensor, ...]]] = {}
    written_back = []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.numel() == 0:
            continue
        contiguous = tuple(t if t.is_contiguous() else t.contiguous() for t in (p, g, m, v))
        written_back += [(p, contiguous[0]), (m, contiguous[2]), (v, contiguous[3])]
        key = (p.device, tuple(t.dtype for t in contiguous))
        groups.setdefault(key, []).append(contiguous)
    for (device, _), tensors in groups.items():
        # The factors in float64, rounded to float32 once (as torch.optim.AdamW's Python
        # floats are): a float32 ``1 - 0.999**step`` is 1.3e-5 off at step 1.
        lr_on = lr.to(device=device, dtype=torch.float64).reshape(())
        step_on = step.to(device=device, dtype=torch.float64)
        step_size = (lr_on / (1 - beta1**step_on)).reshape(())
        bias_correction2_sqrt = torch.sqrt(1 - beta2**step_on).reshape(())
        scalars = tuple(s.to(torch.float32) for s in (lr_on, step_size, bias_correction2_sqrt))
        _launch(tensors, scalars, (beta1, beta2, eps, weight_decay))
    for target, result in written_back:
        if result is not target:
            target.copy_(result)
