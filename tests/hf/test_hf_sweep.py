"""CI's part of the family sweep (``sweep.py``): a fixed sample of cells, each expected to end
as the full sweep found it (equal to one device, or refused by a ``PlanError`` for the reason
recorded), so that a cell which turns wrong, crashes, or starts or stops being refused fails."""

from __future__ import annotations

import pytest
from sweep import SAMPLE, run_cell

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("family", "layout", "expected", "reason"), SAMPLE)
def test_sampled_cell_ends_as_the_sweep_found_it(
    family: str, layout: str, expected: str, reason: str
) -> None:
    cell = run_cell(family, layout)
    assert (cell.result, reason in cell.reason) == (expected, True), cell
