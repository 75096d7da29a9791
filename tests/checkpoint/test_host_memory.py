"""Host buffers of async-save snapshots: mapped ones behave as ordinary CPU tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from d9d.checkpoint._host_memory import host_empty


@pytest.mark.parametrize("shape", [(3, 5), (1024, 1024, 3)], ids=["small", "mapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_host_empty_holds_what_is_copied_in(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    source = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    copy = host_empty(shape, dtype).copy_(source)
    gc.collect()  # the mapping must live as long as the tensor, not the call
    assert copy.shape == source.shape and copy.dtype == dtype and copy.is_contiguous()
    assert torch.equal(copy, source)
