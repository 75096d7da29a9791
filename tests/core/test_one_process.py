"""One process, no ``torchrun``, no process group: a mesh whose axes are all 1 and the
transforms that need no other rank work as on a launched one-rank job (``remat`` crashed in
``place`` with ``'NoneType' object has no attribute 'mesh_dim_names'``; ``make_mesh(fsdp=1)``
refused); a mesh of several ranks says how to launch them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import d9d
from d9d.errors import MeshError
from d9d.models import Llama, LlamaConfig


@pytest.fixture(autouse=True)
def alone() -> Iterator[None]:
    """No process group before the test; ``tests/conftest.py`` destroys the one-rank group
    it started, after it."""
    assert not dist.is_initialized()
    yield


def _grad_step(model: d9d.Model) -> Any:
    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, Any]:
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return grads, opt_state, {"loss": loss}

    return step


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_remat_without_a_mesh_equals_the_step_without_remat(policy: str) -> None:
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=2)).to(torch.float64))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    want, _, want_metrics = _grad_step(model)(model.params, (), batch)

    step = d9d.remat(policy)(_grad_step(model))
    params, state = step.place(model.params, ())
    grads, _, metrics = step(params, state, batch)
    assert dist.get_world_size() == 1 and step.mesh.mesh_dim_names == ("fsdp",)
    assert torch.equal(metrics["loss"], want_metrics["loss"])
    for path, grad in want.items():
        got = grads[path].to_local() if isinstance(grads[path], DTensor) else grads[path]
        assert torch.equal(got, grad), path


def test_make_mesh_of_one_rank_starts_a_one_rank_group_and_refuses_more() -> None:
    with pytest.raises(
        MeshError,
        match=r"make_mesh\(fsdp=2, tp=2\) spans 4 ranks but this process was started alone .*"
        r"`torchrun --nproc-per-node 4 script\.py` and call d9d\.init_process_group\(\) first",
    ):
        d9d.make_mesh("cpu", fsdp=2, tp=2)
    assert not dist.is_initialized()
    mesh = d9d.make_mesh("cpu", fsdp=1, tp=-1)
    assert mesh.mesh_dim_names == ("fsdp", "tp") and tuple(mesh.shape) == (1, 1)
    assert dist.get_world_size() == 1


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({}, r"make_mesh needs at least one axis, e\.g\. make_mesh\(fsdp=1\)"),
        ({"fsdp": 0}, r"mesh axis fsdp=0 must be a positive int or -1"),
        ({"fsdp": "2"}, r"mesh axis fsdp='2' must be a positive int or -1"),
        ({"fsdp": -1, "tp": -1}, r"only one mesh axis may be -1, got \['fsdp', 'tp'\]"),
    ],
)
def test_make_mesh_refuses_bad_axes_before_starting_a_group(axes: dict, message: str) -> None:
    # These were refused only after the one-rank group had started, which outlived the error.
    with pytest.raises(MeshError, match=message):
        d9d.make_mesh("cpu", **axes)
    assert not dist.is_initialized()


def test_make_mesh_under_torchrun_asks_to_join_the_job_first(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(
        MeshError,
        match=r"make_mesh\(fsdp=8\) runs under torchrun \(RANK=3, WORLD_SIZE=8\) but this "
        r"process has not joined the job: call d9d\.init_process_group\(\) before make_mesh",
    ):
        d9d.make_mesh("cpu", fsdp=8)
