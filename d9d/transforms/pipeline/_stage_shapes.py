"""Activation shapes between pipeline stages, found by a probe.

``PipelineStage``s are built with static shapes: stage after stage over the ranks, each runs
microbatch 0 without grad from zeros of the shapes it received and sends the shapes of its
outputs to the next stage's rank (a count, then a small int64 header per tensor). One forward
of one microbatch per new batch shape; PyTorch's own inference would run the stage on meta
tensors (torch 2.11) or a real forward and backward (2.13).

On the meta device (a dry run, as ``d9d plan`` runs one on a simulated world) no rank can
send another a value, so nothing is exchanged: a stage entered from another rank takes the
shapes the rank's own previous stage sent, since the stages between keep them (a decoder's
blocks map hidden states, or a carried state, to the same shapes). The rank must hold stage
0, as rank 0 does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...errors import DryRunError, PlanError

__all__ = ["LOSS_DTYPES", "probe"]

LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# What a stage may pass on: activations, and beside them in a carried state statistics,
# counters and masks (integer and bool tensors carry no grad back).
_ACTIVATION_DTYPES = (
    *LOSS_DTYPES,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_META_LENGTH = 10  # ndim, dtype, up to 8 sizes
Shape = tuple[tuple[int, ...], torch.dtype]


def probe(
    runner: Any, layout: Any, device: torch.device
) -> dict[int, tuple[list[Shape], list[Shape]]]:
    """``{stage: (input shapes, output shapes)}`` of this rank's stages, from a forward of
    microbatch 0 without grad, stage after stage over the ranks. A stage passes one tensor,
    or several (the leaves of a carried state)."""
    out: dict[int, tuple[list[Shape], list[Shape]]] = {}
    previous: list[Shape] | None = None
    dry = device.type == "meta"
    if dry and layout.owner(0) != layout.rank:
        raise DryRunError(
            f"pipeline rank {layout.rank} runs on meta tensors (a dry run), where no rank "
            "sends it the shape of its first stage's input: only the rank holding stage 0 "
            f"(pipeline rank {layout.owner(0)}) can run on meta; run that one"
        )
    for stage in range(layout.split.count):
        owner = layout.owner(stage)
        if owner != layout.rank:
            continue
        entering: list[Shape] = []
        if stage > 0:
            if layout.owner(stage - 1) != layout.rank and not dry:
                previous = _recv_meta(layout, layout.owner(stage - 1), device)
            assert previous is not None
            entering = previous
        inputs = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in entering)
        with torch.no_grad():
            value = runner.run_stage(stage, inputs, 0)
        values = value if isinstance(value, tuple) else (value,)
        previous = [(tuple(v.shape), v.dtype) for v in values]
        _check_passable(stage, previous)
        out[stage] = (entering, previous)
        last = stage + 1 == layout.split.count
        if not last and layout.owner(stage + 1) != layout.rank and not dry:
            _send_meta(layout, layout.owner(stage + 1), previous, device)
    return out


def _check_passable(stage: int, metas: list[Shape]) -> None:
    """Raise for a tensor ``stage`` passes on whose shape and dtype no header describes."""
    for i, (shape, dtype) in enumerate(metas):
        if dtype not in _ACTIVATION_DTYPES or len(shape) > _META_LENGTH - 2:
            raise PlanError(
                f"pipeline stage {stage} passes on tensor {i} of its output as {dtype}"
                f"{list(shape)}, but stages pass tensors of at most {_META_LENGTH - 2} dims "
                f"of {[str(d).removeprefix('torch.') for d in _ACTIVATION_DTYPES]}; carry it "
                "in one of those"
            )


def _send_meta(layout: Any, to: int, metas: list[Shape], device: Any) -> None:
    header = torch.zeros(1 + _META_LENGTH * len(metas), dtype=torch.int64, device=device)
    header[0] = len(metas)
    for i, (shape, dtype) in enumerate(metas):
        row = header[1 + _META_LENGTH * i : 1 + _META_LENGTH * (i + 1)]
        row[0], row[1] = len(shape), _ACTIVATION_DTYPES.index(dtype)
        row[2 : 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    dst = dist.get_global_rank(layout.group, to)
    dist.send(header[:1].clone(), dst=dst, group=layout.group)
    dist.send(header[1:].clone(), dst=dst, group=layout.group)


def _recv_meta(layout: Any, source: int, device: Any) -> list[Shape]:
    src = dist.get_global_rank(layout.group, source)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src=src, group=layout.group)
    header = torch.zeros(_META_LENGTH * int(count), dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=layout.group)
    metas = []
    for row in header.view(-1, _META_LENGTH):
        ndim = int(row[0])
        metas.append((tuple(int(x) for x in row[2 : 2 + ndim]), _ACTIVATION_DTYPES[int(row[1])]))
    return metas
