"""Test helpers (``d9d.testing``): tree assertions, multi-rank runs, simulated worlds."""

from ._checks import assert_tree_all_finite as assert_tree_all_finite
from ._checks import assert_tree_shapes as assert_tree_shapes
from ._compare import assert_trees_all_close as assert_trees_all_close
from ._compare import assert_trees_all_equal as assert_trees_all_equal
from ._fake_world import fake_world as fake_world
from ._kept_bytes import KeptBytes as KeptBytes
from ._peak_rss import peak_rss_growth as peak_rss_growth
from ._ranks import run_on_ranks as run_on_ranks
from ._traces import assert_max_traces as assert_max_traces

__all__ = [
    "KeptBytes",
    "assert_max_traces",
    "assert_tree_all_finite",
    "assert_tree_shapes",
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "fake_world",
    "peak_rss_growth",
    "run_on_ranks",
]
