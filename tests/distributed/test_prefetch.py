"""``shard_params(prefetch=True)``: each block's all-gather is issued before the block before it
(forward) or after it (backward) computes, and waited for only when its own block runs.

The order is read from the collectives themselves: a dispatch mode logs each all-gather's issue
and its wait (``_c10d_functional.all_gather_into_tensor`` / ``wait_tensor``) and each matmul,
interleaved with module hooks marking when each block's forward and backward start and end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import d9d
from d9d.cli._train_step import make_train_step
from d9d.errors import PlanError
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

_c10d = torch.ops._c10d_functional
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
LAYERS = 3


class _Log(TorchDispatchMode):
    """Logs ``("issue", n)`` / ``("wait", n)`` for the ``n``-th all-gather of ``size`` bytes
    (one block's params), and ``("mm",)`` for each matmul."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.events: list[tuple] = []
        self.unwaited: dict[int, int] = {}
        self.issued = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers the op to local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if func is _c10d.all_gather_into_tensor.default and out.numel() * 8 == self.size:
            self.unwaited[out.untyped_storage().data_ptr()] = self.issued
            self.events.append(("issue", self.issued))
            self.issued += 1
        elif func is _c10d.wait_tensor.default:
            n = self.unwaited.pop(args[0].untyped_storage().data_ptr(), None)
            if n is not None:
                self.events.append(("wait", n))
        elif func in _MATMULS:
            self.events.append(("mm",))
        return out


def _events(prefetch: bool) -> list[tuple]:
    """Rank 0's log of one fsdp=2 float64 step of a 3-block Llama."""

    def rank() -> list[tuple]:
        torch.manual_seed(0)
        mesh = d9d.make_mesh("cpu", fsdp=2)
        module = Llama(LlamaConfig.tiny(n_layers=LAYERS)).double()
        model = d9d.functionalize(module)
        opt = d9d.optim.adamw(1e-3)
        step = d9d.shard_params(mesh, prefetch=prefetch)(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        block = sum(v.numel() * 8 for k, v in model.params.items() if k.startswith("layers.0."))
        log = _Log(block)
        mark = log.events.append
        for i, layer in enumerate(module.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: mark(("start", i)))
            layer.register_forward_hook(lambda *_, i=i: mark(("end", i)))
            layer.register_full_backward_pre_hook(lambda *_, i=i: mark(("bstart", i)))
            layer.register_full_backward_hook(lambda *_, i=i: mark(("bend", i)))
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        with log:
            step(params, state, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        return log.events

    return run_on_ranks(rank, 2)[0]


def _at(events: list[tuple], event: tuple) -> int:
    return events.index(event)


def _first_mm_after(events: list[tuple], at: int) -> int:
    return next(i for i in range(at, len(events)) if events[i] == ("mm",))


def test_forward_issues_the_next_blocks_gather_before_the_block_computes() -> None:
    events = _events(prefetch=True)
    # The n-th block-sized all-gather of the forward is block n's.
    for i in range(LAYERS - 1):
        issued, waited = _at(events, ("issue", i + 1)), _at(events, ("wait", i + 1))
        assert issued < _at(events, ("start", i)), events
        assert _at(events, ("end", i)) < waited < _at(events, ("start", i + 1)), events
    # Without prefetch, each block issues its own gather once the block before it is done.
    events = _events(prefetch=False)
    for i in range(LAYERS - 1):
        issued, waited = _at(events, ("issue", i + 1)), _at(events, ("wait", i + 1))
        assert _at(events, ("end", i)) < issued < waited < _at(events, ("start", i + 1)), events


def test_backward_issues_the_previous_blocks_gather_before_the_block_computes() -> None:
    events = _events(prefetch=True)
    # The backward regathers blocks 2, 1, 0: block-sized all-gathers number 3, 4, 5.
    gather_of = {LAYERS - 1 - j: LAYERS + j for j in range(LAYERS)}
    for i in range(LAYERS - 1, 0, -1):
        start, end = _at(events, ("bstart", i)), _at(events, ("bend", i))
        issued = _at(events, ("issue", gather_of[i - 1]))
        waited = _at(events, ("wait", gather_of[i - 1]))
        assert start < issued < _first_mm_after(events, start) < end, events
        assert end < _at(events, ("bstart", i - 1)) < waited, events
    # The last block's own gather is issued while the head's backward computes, before the
    # block's backward starts.
    assert _at(events, ("issue", gather_of[LAYERS - 1])) < _at(events, ("bstart", LAYERS - 1))
    events = _events(prefetch=False)
    for i in range(LAYERS - 1, 0, -1):
        issued = _at(events, ("issue", gather_of[i - 1]))
        assert _at(events, ("bend", i)) < issued, events


def test_prefetch_must_be_a_bool() -> None:
    with pytest.raises(PlanError, match=r"prefetch=True or False, got prefetch='yes'"):
        d9d.shard_params(None, prefetch="yes")  # type: ignore[arg-type]
