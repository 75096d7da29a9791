"""``pin_hash``: a mesh whose ``hash()`` is the same in every process, for inductor's cache.

torch 2.13 passes a ``DeviceMesh`` into a compiled graph as an opaque object, and inductor's
FX graph cache key pickles it whole, with ``_hash``: the ``hash()`` of its layout, cached the
first time the mesh is hashed (a DTensor's spec hashes it). Python salts the hash of a string
(the device type, the axis names) per process, so a restarted run computed another key for
the same graph and compiled it again (``fxgraph_cache_miss``: docs/decisions.md). ``_hash`` is
set here, before anything hashes the mesh, to a hash of what makes two meshes equal that no
process salts; a hash already taken is left as it is (a mesh in a dict or a set keeps the hash
it is filed under). Two equal meshes hash equal when both are pinned: a mesh d9d never saw (a
submesh sliced again, a new object per slice) keeps the salted hash (docs/decisions.md).
"""

from __future__ import annotations

import hashlib

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["pin_hash"]


def pin_hash(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``, its ``hash()`` fixed across processes unless it was taken already."""
    if getattr(mesh, "_hash", None) is None:
        fields = repr((mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist()))
        mesh._hash = int.from_bytes(hashlib.blake2b(fields.encode(), digest_size=7).digest())
    return mesh
