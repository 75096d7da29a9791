"""Token ids past the vocab raise the same named error in every layout, eager and jitted,
before any lookup: torch alone says ``index out of range in self`` on one device, and the
vocab-parallel embedding of ``tensor_parallel`` turned them into zero vectors, silently."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import d9d
from d9d.cli._train_step import make_train_step
from d9d.errors import IndexRangeError
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

NAMED = (
    r"batch\['tokens'\], the index of (an embedding|embedding 'embed') over 256 entries, "
    r"holds {value} at position \({row}, \d+\), outside \[0, 256\)"
)

LAYOUTS: dict[str, tuple[dict[str, int], Callable[..., list]]] = {
    "fsdp=2": ({"fsdp": 2}, lambda mesh: [d9d.shard_params(mesh)]),
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh)]),
    "pp=2": ({"pp": 2}, lambda mesh: [d9d.pipeline(mesh, microbatches=2)]),
}


def _bad_batch(value: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    # Row 1 is a microbatch of its own under pp=2; under cp=2 (zigzag over 4 chunks) rank 0
    # holds positions 0-1 and 6-7, rank 1 positions 2-5: each rank meets one.
    tokens[1, 3] = tokens[1, 7] = value
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def test_one_device_eager_names_the_batch_input_and_the_vocab() -> None:
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
    opt = d9d.optim.sgd(0.1)
    step = make_train_step(model, opt)
    for value in (256, -3):
        with pytest.raises(IndexRangeError, match=NAMED.format(value=value, row=1)):
            step(model.params, opt.init(model.params), _bad_batch(value))
    with pytest.raises(IndexRangeError, match=r"^the index of embedding 'embed' over 256"):
        model.apply(model.params, torch.tensor([[1, 256]]))  # no value_and_grad to name it


def _rank(layout: str, jit: bool) -> None:
    axes, transforms = LAYOUTS[layout]
    mesh = d9d.make_mesh("cpu", **axes)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=2 if layout == "pp=2" else 1)))
    opt = d9d.optim.sgd(0.1)
    step = make_train_step(model, opt)
    for transform in transforms(mesh):
        step = transform(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    if jit:
        step = d9d.jit(step, backend="aot_eager", donate=())
    if layout == "pp=2" and torch.distributed.get_rank() == 1:
        # The last stage holds no embedding: it loses its peer, whose error says why.
        with pytest.raises(RuntimeError):
            step(params, state, _bad_batch(256))
        torch.distributed.destroy_process_group()
        return
    with pytest.raises(IndexRangeError, match=NAMED.format(value=256, row=1)):
        step(params, state, _bad_batch(256))
    if layout == "pp=2":
        # As the process that raised would exit: its peer, blocked on it, fails.
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("layout", "jit"),
    # Jitted, the vocab-parallel embedding's own check is named by jit's graph pass (the other
    # layouts' lookups are guarded there as on one device; tests/core/test_jit.py).
    [(layout, False) for layout in LAYOUTS] + [("tp=2", True)],
)
def test_every_layout_names_the_batch_input_and_the_vocab(layout: str, jit: bool) -> None:
    # Send and recv (pipeline) need process ranks; the rest run on thread ranks.
    run_on_ranks(_rank, 2, layout, jit, method="fork" if layout == "pp=2" else "thread")


FLOAT_IDS = (
    r"batch\['tokens'\], the index of embedding 'embed' over 256 entries, holds torch.float32 "
    r"values, not ids; pass token ids as an integer tensor \(e.g. tokens.long\(\)\)"
)


def _float_rank(layout: str | None) -> None:
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
    opt = d9d.optim.sgd(0.1)
    step = make_train_step(model, opt)
    params, state = model.params, opt.init(model.params)
    if layout is not None:
        axes, transforms = LAYOUTS[layout]
        for transform in transforms(d9d.make_mesh("cpu", **axes)):
            step = transform(step)
        params, state = step.place(params, state, model=model)
    batch = _bad_batch(1)
    with pytest.raises(TypeError, match=FLOAT_IDS):
        step(params, state, {**batch, "tokens": batch["tokens"].float()})


@pytest.mark.parametrize("layout", [None, "tp=2"])
def test_float_token_ids_are_named(layout: str | None) -> None:
    """Float token ids raised torch's 'Expected tensor for argument #1 'indices' to have one of
    the following scalar types: Long, Int; but got torch.FloatTensor' from the lookup (the
    vocab-parallel one of tensor_parallel too), naming neither the input nor the fix."""
    if layout is None:
        _float_rank(None)
    else:
        run_on_ranks(_float_rank, 2, layout)
