"""``pipeline`` over models whose forward does more than run its blocks in order: it reads
attributes of blocks and embeddings (equal to one device), runs blocks again, calls a module
outside the blocks between them, or holds params beside its blocks (each refused by name).
Found by the family sweep (``tests/hf/sweep.py``): NemotronH, Dory, Llama-4, HRM. And blocks
carrying integer or bool tensors in their state (equal to one device), or one no stage can
pass (refused by name)."""

from __future__ import annotations

import copy

import pytest
import torch
from equivalence import assert_equivalent, batches, reference
from torch import nn

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

VOCAB, WIDTH = 11, 8


class _Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind  # read by the model, as NemotronH reads block_type
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * torch.tanh(self.proj(x))


class _Model(nn.Module):
    """Four blocks; ``shape`` picks what the forward does besides running them in order."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([_Block(k) for k in ("a", "b", "a", "b")])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        if shape == "param beside blocks":
            self.start = nn.Parameter(torch.zeros(WIDTH))  # as HRM's z_L_init
        if shape == "blocks sharing a weight":
            self.layers[1].proj.weight = self.layers[0].proj.weight  # as ALBERT's shared layers
        if shape == "aux loss from blocks":
            self.layers = nn.ModuleList([_AuxBlock(k) for k in ("a", "b", "a", "b")])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        device = self.embed.weight.device  # as Llama-4 reads embed_tokens.weight.device
        x = self.embed(tokens.to(device))
        scales = {"a": 1.0, "b": 0.5}
        if self.shape == "param beside blocks":
            x = x + self.start
        aux = 0.0
        for i, layer in enumerate(self.layers):
            x = layer(x, scales[layer.kind])
            if self.shape == "aux loss from blocks":
                x, block_aux = x
                aux = aux + block_aux
            if self.shape == "norm between blocks" and i == 1:
                x = self.norm(x)  # as Dory's norm between its sections
        if self.shape == "looped":
            for layer in self.layers[1:3]:  # as Dory's recurrent section
                x = layer(x)
        return self.head(self.norm(x)) + aux


class _AuxBlock(_Block):
    """A block that returns an aux loss beside its activation, which the model sums."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        y = super().forward(x, scale)
        return y, y.square().mean()


def _builder(shape: str):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = _Model(shape).to(torch.float64)
    return lambda: d9d.functionalize(copy.deepcopy(module))


def _pp2_equals_one_device(build) -> None:
    """pp=2, 2 microbatches, 2 AdamW steps in float64 against one device."""
    data = batches(VOCAB, global_batch=4, seq_len=8, steps=2)
    assert_equivalent(
        build,
        lambda mesh: [d9d.pipeline(mesh, microbatches=2)],
        {"pp": 2},
        data,
        reference(build, data),
        dtype=torch.float64,
        method="fork",
    )


def test_attributes_of_blocks_and_embedding_read_on_every_stage_equal_one_device() -> None:
    """A stand-in answers attribute reads as its module (a block's ``kind``, the embedding's
    ``weight``): before, every stage but the first crashed with an AttributeError."""
    _pp2_equals_one_device(_builder("plain"))


def _train_rank(build) -> None:
    mesh = d9d.make_mesh("cpu", pp=2)
    model = build()

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    @d9d.pipeline(mesh, stages=["layers.1"], microbatches=2)  # the norm runs on the last stage
    def step(params, opt_state, batch):
        loss, _ = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, {"loss": loss}

    params, state = step.place(model.params, (), model=model)
    step(params, state, batches(VOCAB, global_batch=4, seq_len=8, steps=1)[0])


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ("looped", r"runs block 'layers\.1' again after block 3 in one forward"),
        ("norm between blocks", r"module 'norm' runs between the model's blocks"),
        ("param beside blocks", r"cannot place params \['start'\] of module '_Model', which holds"),
        (
            "aux loss from blocks",
            r"pipeline stage 0: block 'layers\.0' takes one activation but returns 2 tensors "
            r"\(a tuple\), and pipeline passes only a block's activation between stages",
        ),
    ],
)
def test_forwards_that_cannot_be_cut_are_refused_by_name(shape: str, match: str) -> None:
    """Before, the looped model and the norm between blocks trained silently wrong (the
    second stage recomputed the skipped part from zeros) and the param beside the blocks
    crashed inside the model. Blocks returning an aux loss beside their activation crashed
    every later stage (``ValueError: too many values to unpack``: a skipped block passed its
    activation alone), and with microbatches of two sequences the later stages would have
    unpacked its rows as the activation and the aux loss; the other blocks' aux losses could
    never reach the last stage."""
    with pytest.raises(RankFailedError, match=r"PlanError: .*" + match):
        run_on_ranks(_train_rank, 2, _builder(shape), method="fork")


def _zbv_rank(build) -> None:
    mesh = d9d.make_mesh("cpu", pp=2)
    model = build()
    step = d9d.pipeline(mesh, schedule="zbv", microbatches=2, virtual_stages=2)(
        lambda params, opt_state, batch: (params, opt_state, {})
    )
    step.place(model.params, (), model=model)


def test_a_weight_shared_by_stages_of_two_ranks_besides_the_end_ones_is_refused_by_name() -> None:
    """Under zbv the first and last stage share rank 0; blocks 0 and 1 (stages 0 and 1, ranks
    0 and 1) sharing a weight had its grads summed over no group: every rank crashed with
    ``AttributeError: 'NoneType' object has no attribute 'group_name'`` in the step, as a
    3-rank 1F1B pipeline did with blocks of ranks 0 and 1, or 1 and 2, sharing one."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: param 'layers\.0\.proj\.weight' is shared by stages \[0, 1\], on "
        r"pipeline ranks \[0, 1\], but pipeline sums a shared param's grads only between the "
        r"first and last stage's ranks \[0\]",
    ):
        run_on_ranks(_zbv_rank, 2, _builder("blocks sharing a weight"), method="fork")


class _CarryingBlock(nn.Module):
    """A block of a carried state ``(hidden, extra)``: an int64 count of the blocks run so far
    (scaling each block's update), a bool mask of the tokens it updates, or a complex tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, extra = state
        update = torch.tanh(self.proj(x))
        if extra.dtype == torch.int64:
            return x + update / (1 + extra[:, None, None]), extra + 1
        if extra.dtype == torch.bool:
            return x + update * extra[..., None], extra
        return x + update, extra * 2


class _Carrying(nn.Module):
    def __init__(self, extra: torch.dtype) -> None:
        super().__init__()
        self.extra = extra
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([_CarryingBlock() for _ in range(4)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.extra == torch.bool:
            extra = tokens > VOCAB // 2
        else:
            extra = torch.zeros(tokens.shape[0], dtype=self.extra)
        state = (x, extra)
        for layer in self.layers:
            state = layer(state)
        return self.head(state[0])


def _carrying(extra: torch.dtype):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = _Carrying(extra).to(torch.float64)
    return lambda: d9d.functionalize(copy.deepcopy(module))


@pytest.mark.parametrize("extra", [torch.int64, torch.bool], ids=["int64", "bool"])
def test_integer_and_bool_tensors_of_a_carried_state_cross_stages(extra: torch.dtype) -> None:
    """Before, the stage-shape probe knew float dtypes only and every rank failed with
    ``ValueError: tuple.index(x): x not in tuple``."""
    _pp2_equals_one_device(_carrying(extra))


def test_a_carried_tensor_no_stage_can_pass_is_refused_by_name() -> None:
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: pipeline stage 0 passes on tensor 1 of its output as "
        r"torch\.complex128\[2\], but stages pass tensors of at most 8 dims of \['float32'",
    ):
        run_on_ranks(_train_rank, 2, _carrying(torch.complex128), method="fork")
