"""d9d.losses.cross_entropy against F.cross_entropy and the z-loss formula."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from d9d.losses import _cross_entropy, cross_entropy


def _case(
    *lead: int, vocab: int = 37, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=g)
    labels[torch.rand(lead, generator=g) < 0.3] = -100
    return logits, labels


def test_docstring_examples_run() -> None:
    assert doctest.testmod(_cross_entropy, raise_on_error=True).attempted > 0


@pytest.mark.parametrize("lead", [(11,), (3, 7), (2, 3, 5)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(lead: tuple[int, ...], reduction: str) -> None:
    logits, labels = _case(*lead)
    logits.requires_grad_()
    got = cross_entropy(logits, labels, reduction=reduction)
    expected = F.cross_entropy(logits.reshape(-1, 37), labels.reshape(-1), reduction=reduction)
    torch.testing.assert_close(got, expected.reshape(got.shape))
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


def test_custom_ignore_index() -> None:
    logits, labels = _case(4, 6)
    labels[labels == -100] = 3
    got = cross_entropy(logits, labels, ignore_index=3)
    torch.testing.assert_close(
        got, F.cross_entropy(logits.reshape(-1, 37), labels.flatten(), ignore_index=3)
    )


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32], ids=str)
def test_labels_of_any_integer_dtype(dtype: torch.dtype) -> None:
    # 300 classes: uint8 labels compared with the vocab size once wrapped it to 44
    # (every label >= 44 "outside"), and gather refused indices narrower than int32.
    logits, labels = _case(4, 6, vocab=300)
    labels = labels.clamp(max=torch.iinfo(dtype).max)
    ignore = -100 if dtype.is_signed else 255
    labels[labels == -100] = ignore
    got = cross_entropy(logits, labels.to(dtype), ignore_index=ignore, reduction="none")
    expected = F.cross_entropy(
        logits.reshape(-1, 300), labels.flatten(), ignore_index=ignore, reduction="none"
    )
    torch.testing.assert_close(got, expected.reshape(got.shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_computed_in_fp32(dtype: torch.dtype) -> None:
    logits, labels = _case(4, 9, dtype=dtype)
    got = cross_entropy(logits, labels)
    assert got.dtype == torch.float32
    expected = F.cross_entropy(logits.float().reshape(-1, 37), labels.flatten())
    torch.testing.assert_close(got, expected)  # fp32 tolerance; in bf16 it is 8e-3 off


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_z_loss_matches_formula(reduction: str) -> None:
    logits, labels = _case(5, 8, seed=1)
    valid = labels != -100
    lse = torch.logsumexp(logits, dim=-1)[valid]
    ce = F.cross_entropy(logits.reshape(-1, 37), labels.flatten(), reduction="sum")
    z = (lse**2).sum()
    count = valid.sum() if reduction == "mean" else 1
    expected = (ce + 1e-2 * z) / count
    torch.testing.assert_close(
        cross_entropy(logits, labels, z_loss=1e-2, reduction=reduction), expected
    )


def test_all_ignored_gives_zero_loss_and_zero_grads() -> None:
    logits = torch.randn(3, 4, 37, requires_grad=True)
    labels = torch.full((3, 4), -100)
    loss = cross_entropy(logits, labels, z_loss=1e-3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.compile  # aot_eager: checks tracing without inductor codegen (~2 s)
def test_traces_fullgraph_without_graph_breaks() -> None:
    logits, labels = _case(2, 6)
    compiled = torch.compile(cross_entropy, fullgraph=True, backend="aot_eager")
    for lab in (labels, torch.full_like(labels, -100)):
        torch.testing.assert_close(
            compiled(logits, lab, z_loss=1e-3), cross_entropy(logits, lab, z_loss=1e-3)
        )


@pytest.mark.parametrize(
    ("logits", "labels", "kwargs", "match"),
    [
        (
            torch.zeros(2, 3, 5),
            torch.zeros(2, 4, dtype=torch.long),
            {},
            r"logits.shape\)=\(2, 3, 5\) and tuple\(labels.shape\)=\(2, 4\)",
        ),
        (
            torch.zeros(2, 5),
            torch.zeros(2, 1, dtype=torch.long),
            {},
            r"labels of shape logits.shape\[:-1\]",
        ),
        (
            torch.zeros(()),
            torch.zeros((), dtype=torch.long),
            {},
            r"labels of shape logits.shape\[:-1\]",
        ),
        (
            torch.zeros(2, 5),
            torch.zeros(2),
            {},
            r"integer class ids as labels, got labels.dtype=torch.float32",
        ),
        (
            torch.zeros(2, 5, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
            {},
            r"floating logits, got logits.dtype=torch.int64",
        ),
        (
            torch.zeros(2, 5),
            torch.zeros(2, dtype=torch.long),
            {"reduction": "avg"},
            r"reduction='avg'; use one of \('mean', 'sum', 'none'\)",
        ),
        (
            torch.zeros(2, 5),
            torch.zeros(2, dtype=torch.long),
            {"z_loss": -1.0},
            r"z_loss >= 0, got z_loss=-1.0",
        ),
    ],
)
def test_rejects_bad_arguments(
    logits: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, labels, **kwargs)
