"""``computes_without_grad`` reads ``torch.no_grad()`` / ``torch.inference_mode()`` off a
module's forward, through other decorators."""

from __future__ import annotations

import functools

import torch
from torch import nn

from d9d.core._grad_mode import computes_without_grad


def _logged(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


class _NoGrad(nn.Linear):
    @torch.no_grad()
    @_logged  # transformers wraps forwards in deprecate_kwarg beneath no_grad
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).topk(1).indices


class _Inference(nn.Linear):
    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _EnableGrad(nn.Linear):
    @torch.enable_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _Logged(nn.Linear):
    @_logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_modules_decorated_to_compute_without_grad_are_found() -> None:
    assert computes_without_grad(_NoGrad(4, 4))
    assert computes_without_grad(_Inference(4, 4))
    assert not computes_without_grad(_EnableGrad(4, 4))
    assert not computes_without_grad(_Logged(4, 4))
    assert not computes_without_grad(nn.Linear(4, 4))
    assert not _NoGrad(4, 4)(torch.ones(2, 4, requires_grad=True)).requires_grad
