"""Cutting a model into pipeline stages: balance, ownership of params outside blocks, errors."""

from __future__ import annotations

import pytest
import torch

import d9d
from d9d.errors import PlanError
from d9d.models import Llama, LlamaConfig
from d9d.transforms.pipeline._stages import _balanced, split_stages


def _model(n_layers: int = 4, **config: object) -> d9d.Model:
    return d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=n_layers, **config), device="meta"))


@pytest.mark.parametrize(
    ("costs", "tail", "count", "cuts"),
    [
        ([1, 1, 1, 1], 0, 2, (2,)),
        ([1, 1, 1, 1], 2, 2, (3,)),  # the head costs two blocks: 3 | 1 + 2
        ([5, 1, 1, 1, 1, 1], 0, 2, (1,)),
        ([1, 1, 1, 1, 1, 1, 1, 1], 0, 4, (2, 4, 6)),
        ([1, 1, 1], 0, 3, (1, 2)),
    ],
)
def test_balanced_cuts_minimize_the_costliest_stage(costs, tail, count, cuts) -> None:
    assert _balanced(costs, tail, count) == cuts


def test_split_gives_every_param_to_one_stage_and_ends_to_the_ends() -> None:
    model = _model(4)
    split = split_stages(model, 2)
    assert split.before == ("embed",) and split.after == ("norm", "head")
    assert sum(len(k) for k in split.keys) == len(model.params)
    assert "embed.weight" in split.keys[0] and "head.weight" in split.keys[1]
    assert split.blocks[0][0] == 0 and split.blocks[-1][1] == 4
    assert "stage 0: layers.0" in split.describe()


def test_head_cost_moves_blocks_to_the_first_stage() -> None:
    # vocab 4096 x dim 64: the head costs more than one block, so stage 0 takes three.
    split = split_stages(_model(4, vocab_size=4096), 2)
    assert split.blocks == ((0, 3), (3, 4))


def test_tied_embedding_is_held_by_both_end_stages() -> None:
    split = split_stages(_model(4, tie_embeddings=True), 3)
    assert split.stages_of("embed.weight") == (0, 2)


def test_split_paths() -> None:
    split = split_stages(_model(6), 3, ["layers.1", "layers.5"])
    assert split.blocks == ((0, 1), (1, 5), (5, 6))


@pytest.mark.parametrize(
    ("count", "paths", "match"),
    [
        (5, None, "needs 5 stages but the model has only 4 blocks"),
        (2, ["layers.9"], r"\['layers.9'\] are not blocks"),
        (3, ["layers.2", "layers.1"], "distinct blocks in model order"),
        (3, ["layers.2"], "make 2 stages but the mesh and virtual_stages give 3"),
    ],
)
def test_split_errors_name_the_problem(count, paths, match) -> None:
    with pytest.raises(PlanError, match=match):
        split_stages(_model(4), count, paths)


def test_a_carried_state_enters_the_stage_leaf_by_leaf() -> None:
    """A block taking a tuple (a carried state) gets the previous stage's tensors rebuilt into
    its structure; a count that does not match the state is named."""
    from d9d.core._structure import Block
    from d9d.models.moe import MoEState
    from d9d.transforms.pipeline._layout import StageRun
    from d9d.transforms.pipeline._stage_apply import _enter_block

    sent = (torch.ones(2, 3), torch.tensor(0.5), torch.ones(1, 4))
    local = MoEState(torch.zeros(2, 3), torch.tensor(0.0), torch.zeros(1, 4))
    block = Block(1, "layers.1", torch.nn.Identity(), ())
    run = StageRun(1, 1, 2, first=False, last=True, input=sent)
    (state, cos), _ = _enter_block(run, block, (local, "cos"), {})
    assert type(state) is MoEState and run.carried and cos == "cos"
    assert all(a is b for a, b in zip(state, sent, strict=True))
    run = StageRun(1, 1, 2, first=False, last=True, input=sent[:2])
    with pytest.raises(PlanError, match=r"block 1 takes a state of 3 tensors but the stage "):
        _enter_block(run, block, (local,), {})
