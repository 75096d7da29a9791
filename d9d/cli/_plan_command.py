"""``d9d plan``: the sharding plan and per-rank memory of a preset on a simulated mesh."""

from __future__ import annotations

import torch

from .. import optim
from .._mesh import make_mesh
from .._model import functionalize
from ..models import Llama, LlamaConfig, MoE, MoEConfig
from ..testing import fake_world
from ..transforms import shard_params

__all__ = ["show_plan"]


def show_plan(
    preset: str, *, model: str = "llama", dp: int = 1, fsdp: int = 1, max_rows: int | None = 24
) -> str:
    """The plan table, per-rank memory (AdamW) and one explained param, as text.

    The model is built on the meta device and the ranks are simulated (``fake_world``), so a
    plan for thousands of GPUs prints in seconds on a laptop.

    Args:
        preset: A ``LlamaConfig.preset`` (or, with ``model="moe"``, ``MoEConfig.preset``) name.
        model: ``"llama"`` or ``"moe"``.
        dp: Ranks the model is replicated over.
        fsdp: Ranks the model is sharded over.
        max_rows: Rows of the table to show (the middle is elided); None shows all.

    Returns:
        The report.

    Example:
        >>> print(show_plan("tiny", fsdp=2, max_rows=4).splitlines()[0])  # doctest: +ELLIPSIS
        d9d plan on mesh dp=1 x fsdp=2 (cpu)...
    """
    if model not in ("llama", "moe"):
        raise ValueError(f"--model must be llama or moe, got {model!r}")
    if dp < 1 or fsdp < 1:
        raise ValueError(f"--dp and --fsdp must be >= 1, got dp={dp} and fsdp={fsdp}")
    world = dp * fsdp
    with fake_world(world), torch.device("meta"):
        mesh = make_mesh("cpu", dp=dp, fsdp=fsdp)
        module = (
            Llama(LlamaConfig.preset(preset)) if model == "llama" else MoE(MoEConfig.preset(preset))
        )
        functional = functionalize(module)
        opt = optim.adamw(1e-4)
        step = shard_params(mesh, "fsdp", replicate_axis="dp")(lambda p, s, b: (p, s, {}))
        params, state = step.place(
            functional.params, opt.init(functional.params), axes=functional.axes
        )
        memory = step.memory(params, state)
        first_matrix = next(
            p for p, t in functional.params.items() if t.ndim == 2 and p.startswith("layers.")
        )
        lines = [
            step.plan.table(max_rows=max_rows).rstrip(),
            f"per rank with AdamW: {memory}",
            step.plan.explain(first_matrix),
        ]
    return "\n".join(lines)
