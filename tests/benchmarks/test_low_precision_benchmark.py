"""benchmarks/low_precision.py, short: 50 steps of the tiny Llama with bfloat16 params.
Stochastic rounding ends within 1% of float32 master weights; round-to-nearest does worse.
(The 200-step figures are in docs/optim.md, from the benchmark's own command.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def low_precision(load_benchmark):
    return load_benchmark("low_precision")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: a tiny step took 0.08 s so, and 0.5-1.2 s on two threads of a
    2-core machine shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_stochastic_rounding_keeps_the_float32_master_loss(low_precision, one_thread) -> None:
    final = {
        variant: low_precision.final_loss(
            low_precision.train(variant, steps=50, batch_size=8, seq_len=64), last=10
        )
        for variant in (
            "float32 master",
            "bfloat16, round to nearest",
            "bfloat16, stochastic rounding",
        )
    }
    master = final["float32 master"]
    stochastic = final["bfloat16, stochastic rounding"]
    nearest = final["bfloat16, round to nearest"]
    assert abs(stochastic / master - 1) < 0.01, final
    assert nearest > stochastic and nearest > master, final
