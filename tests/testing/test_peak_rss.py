"""``peak_rss_growth`` counts what a call allocates, also in a rank forked from a process
whose freed heap is still resident."""

from __future__ import annotations

import torch

from d9d.testing import peak_rss_growth, run_on_ranks

MIB = 2**20


def _hold_150_mib() -> list[torch.Tensor]:
    return [torch.ones(MIB // 16) for _ in range(600)]  # 600 x 256 KiB: heap chunks


def _measured() -> int:
    return peak_rss_growth(_hold_150_mib)[1]


def test_a_forked_rank_counts_allocations_that_reuse_its_parents_freed_heap() -> None:
    freed = [torch.ones(MIB // 16) for _ in range(1200)]  # 300 MiB, then freed, still resident
    del freed
    assert run_on_ranks(_measured, 1, method="fork")[0] >= 150 * MIB
