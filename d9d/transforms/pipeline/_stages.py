"""Where ``pipeline`` cuts a model: contiguous runs of blocks, one run per stage.

A stage is a run of blocks (the children of the model's outermost ``nn.ModuleList``). The
params outside blocks go with the modules that own them: a module registered before the
blocks (the embedding) runs on the first stage, one registered after them (final norm,
output head) on the last. A param tied between the two (a head sharing the embedding matrix)
is held by both stages, and its grads are summed over them.

Without split paths the blocks are balanced by cost: a block costs the FLOPs per token of its
matmuls (two per weight element, so its param count), the last stage also pays for a head
(``nn.Linear``) after the blocks; an embedding lookup costs nothing. The split minimizes the
cost of the most expensive stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ...core._structure import Structure
from ...errors import PlanError

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["StageSplit", "split_stages"]


@dataclass(frozen=True)
class StageSplit:
    """The blocks and params of every stage.

    Attributes:
        blocks: Per stage, the ``[start, stop)`` range of its blocks (indices into the
            model's param-owning blocks, in order).
        block_paths: The path of every block, e.g. ``layers.3``.
        keys: Per stage, the (canonical) paths of the params it holds.
        before: Paths of the modules owning params that run before the blocks (first stage).
        after: Paths of the modules owning params that run after the blocks (last stage).
    """

    blocks: tuple[tuple[int, int], ...]
    block_paths: tuple[str, ...]
    keys: tuple[tuple[str, ...], ...]
    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def count(self) -> int:
        """The number of stages."""
        return len(self.blocks)

    def stages_of(self, key: str) -> tuple[int, ...]:
        """The stages holding param ``key``."""
        return tuple(s for s, keys in enumerate(self.keys) if key in keys)

    def describe(self) -> str:
        """One line per stage: its blocks."""
        lines = []
        for s, (start, stop) in enumerate(self.blocks):
            extra = (" + " + ", ".join(self.before) if s == 0 and self.before else "") + (
                " + " + ", ".join(self.after) if s == self.count - 1 and self.after else ""
            )
            lines.append(
                f"stage {s}: {self.block_paths[start]} .. {self.block_paths[stop - 1]}{extra}"
            )
        return "\n".join(lines)


def split_stages(model: Model, count: int, split_paths: Sequence[str] | None = None) -> StageSplit:
    """Cut ``model`` (a :class:`d9d.Model`) into ``count`` stages.

    Args:
        model: The functionalized model.
        count: The number of stages (pipeline ranks times virtual stages).
        split_paths: Block paths that begin stages 1, 2, ... (``["layers.4", "layers.8"]``
            makes three stages), or None to balance by cost.

    Returns:
        The :class:`StageSplit`.

    Raises:
        PlanError: The model has no blocks, fewer blocks than stages, or a split path is
            not a block, out of order, or gives another number of stages.
    """
    structure = model.structure
    if not structure.blocks:
        raise PlanError(
            "pipeline cuts a model between the children of its nn.ModuleList of blocks, and "
            f"{type(model.module).__name__} has none; keep the blocks in an nn.ModuleList"
        )
    paths = tuple(block.path for block in structure.blocks)
    if count > len(paths):
        raise PlanError(
            f"pipeline needs {count} stages but the model has only {len(paths)} blocks "
            f"({paths[0]} .. {paths[-1]}); use fewer pp ranks or virtual_stages"
        )
    before, after = _root_sides(structure)
    if split_paths is None:
        cuts = _balanced(_block_costs(structure), _head_cost(structure, after), count)
    else:
        cuts = _cuts_from_paths(paths, list(split_paths), count)
    bounds = (0, *cuts, len(paths))
    blocks = tuple((bounds[s], bounds[s + 1]) for s in range(count))
    _check_shared(structure, blocks)
    keys = []
    for s, (start, stop) in enumerate(blocks):
        held = [
            structure.canonical(slot.key) for b in structure.blocks[start:stop] for slot in b.slots
        ]
        if s == 0:
            held = [k for owner in before for k in structure.root_owners[owner]] + held
        if s == count - 1:
            held += [k for owner in after for k in structure.root_owners[owner]]
        keys.append(tuple(k for k in dict.fromkeys(held)))
    return StageSplit(blocks, paths, tuple(keys), before, after)


def _check_shared(structure: Structure, blocks: tuple[tuple[int, int], ...]) -> None:
    """Raise for a param that a block and a module outside the blocks both hold (a module
    shared between them): the stages would each train a copy of their own. One that blocks of
    several stages share is left to the transform's check (summed between the end stages)."""
    root = {k for keys in structure.root_owners.values() for k in keys}
    for s, (start, stop) in enumerate(blocks):
        for block in structure.blocks[start:stop]:
            for slot in block.slots:
                key = structure.canonical(slot.key)
                if key in root:
                    raise PlanError(
                        f"pipeline cannot place param {key!r}: block {block.path!r} of stage "
                        f"{s} and a module outside the blocks both hold it (a module shared "
                        "between them), and each stage would train a copy of its own; share it "
                        "only within the blocks of one stage (split_paths), or use another "
                        "layout than pipeline"
                    )


def _root_sides(structure: Structure) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Owners of params outside blocks, split by whether they are registered before the
    first block or after it."""
    order = [path for path, _ in structure.module.named_modules()]
    first_block = order.index(structure.blocks[0].path)
    before, after = [], []
    for owner in structure.root_owners:
        if any(b.path.startswith(owner + "." if owner else "") for b in structure.blocks):
            # Its params are read by the code around the blocks (HRM's z_L_init), which no
            # one stage runs alone.
            raise PlanError(
                f"pipeline cannot place params {list(structure.root_owners[owner])} of module "
                f"{owner or type(structure.module).__name__!r}, which holds the blocks itself: "
                "they are neither before nor after the blocks, so no one stage owns them; "
                "move them into a child module registered before or after the blocks, or use "
                "another layout than pipeline"
            )
        (before if order.index(owner) < first_block else after).append(owner)
    return tuple(before), tuple(after)


def _block_costs(structure: Structure) -> list[int]:
    return [sum(slot.store()[slot.name].numel() for slot in b.slots) for b in structure.blocks]


def _head_cost(structure: Structure, after: tuple[str, ...]) -> int:
    cost = 0
    for owner in after:
        module = structure.module.get_submodule(owner)
        if isinstance(module, nn.Linear):
            cost += module.weight.numel()
    return cost


def _balanced(costs: list[int], tail: int, count: int) -> tuple[int, ...]:
    """Cut points (block indices starting stages 1..count-1) minimizing the largest stage
    cost, the last stage paying ``tail`` on top of its blocks."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least largest cost of blocks [0, i) in s stages; choice[s][i]: the cut.
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    choice = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for s in range(1, count + 1):
        for i in range(s, n + 1):
            extra = tail if (s == count and i == n) else 0
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], choice[s][i] = cost, j
    cuts, i = [], n
    for s in range(count, 0, -1):
        i = choice[s][i]
        cuts.append(i)
    return tuple(reversed(cuts[:-1]))


def _cuts_from_paths(paths: tuple[str, ...], split: list[str], count: int) -> tuple[int, ...]:
    missing = [p for p in split if p not in paths]
    if missing:
        raise PlanError(
            f"pipeline split paths {missing} are not blocks of the model; blocks are "
            f"{paths[0]!r} .. {paths[-1]!r} (a split path names the first block of a stage)"
        )
    cuts = [paths.index(p) for p in split]
    if cuts != sorted(set(cuts)) or 0 in cuts:
        raise PlanError(
            f"pipeline split paths {split} must be distinct blocks in model order, after "
            f"{paths[0]!r} (which always begins stage 0)"
        )
    if len(cuts) + 1 != count:
        raise PlanError(
            f"pipeline split paths {split} make {len(cuts) + 1} stages but the mesh and "
            f"virtual_stages give {count}; pass {count - 1} split paths"
        )
    return tuple(cuts)
