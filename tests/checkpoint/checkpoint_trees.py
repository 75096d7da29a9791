"""A realistic tree to checkpoint (tiny Llama params, AdamW state, odd leaves) and layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from d9d import optim
from d9d import tree as tree_lib
from d9d.models import Llama, LlamaConfig


def train_tree() -> dict[str, Any]:
    """Params and optimizer state of a tiny Llama after one update, plus awkward leaves."""
    params = dict(Llama(LlamaConfig.tiny()).named_parameters())
    params = {k: v.detach().clone() for k, v in params.items()}
    opt = optim.adamw(1e-3)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    grads = {k: torch.randn(v.shape, generator=generator) for k, v in params.items()}
    _, state = opt.update(grads, state, params)
    odd = {
        "uneven": torch.randn(7, 3, generator=generator),  # 7 rows over 4 ranks: 2, 2, 2, 1
        "sparse": torch.randn(3, 5, generator=generator),  # 3 rows over 4 ranks: one empty
        "bf16": torch.randn(6, 10, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(12, dtype=torch.int32).reshape(4, 3),
        "scalar": torch.tensor(2.5),
        "zeros": torch.zeros(5, 2),  # zarr skips chunks equal to the fill value unless told
    }
    return {"params": params, "opt_state": state, "odd": odd, "step": 1, "name": "tiny"}


TREE = train_tree()

Rule = Callable[[torch.Tensor], list[Placement]]


def fsdp(t: torch.Tensor) -> list[Placement]:
    return [Shard(0) if t.ndim else Replicate()]


def dp_fsdp(t: torch.Tensor) -> list[Placement]:
    return [Replicate(), Shard(0) if t.ndim else Replicate()]


def fsdp_tp(t: torch.Tensor) -> list[Placement]:
    return [
        Shard(0) if t.ndim >= 1 else Replicate(),
        Shard(1) if t.ndim >= 2 else Replicate(),
    ]


LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], Rule]] = {
    "fsdp=4": ((4,), ("fsdp",), fsdp),
    "fsdp=2": ((2,), ("fsdp",), fsdp),
    "dp=2 x fsdp=2": ((2, 2), ("dp", "fsdp"), dp_fsdp),
    "fsdp=2 x tp=2": ((2, 2), ("fsdp", "tp"), fsdp_tp),
}


def place(tree: Any, layout: str) -> tuple[Any, DeviceMesh]:
    """``tree`` with every tensor distributed on this rank's mesh for ``layout``."""
    shape, names, rule = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def leaf(x: Any) -> Any:
        return distribute_tensor(x, mesh, rule(x)) if isinstance(x, torch.Tensor) else x

    return tree_lib.map(leaf, tree), mesh
