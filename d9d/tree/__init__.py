"""Pytrees with string paths (``d9d.tree``), on optree; a DTensor is one leaf."""

from ._paths import PyTreeSpec as PyTreeSpec
from ._paths import flatten as flatten
from ._paths import flatten_with_paths as flatten_with_paths
from ._paths import leaves as leaves
from ._paths import leaves_with_paths as leaves_with_paths
from ._paths import map as map  # noqa: A004
from ._paths import map_with_path as map_with_path
from ._paths import paths as paths
from ._paths import same_paths as same_paths
from ._paths import same_structure as same_structure
from ._paths import structure as structure
from ._paths import unflatten as unflatten
from ._paths import with_leaves as with_leaves

__all__ = [
    "PyTreeSpec",
    "flatten",
    "flatten_with_paths",
    "leaves",
    "leaves_with_paths",
    "map",
    "map_with_path",
    "paths",
    "same_paths",
    "same_structure",
    "structure",
    "unflatten",
    "with_leaves",
]
