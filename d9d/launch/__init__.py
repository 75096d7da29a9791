"""Joining a ``torchrun`` job (``d9d.launch``): the default process group, scoped so that a
restarted round never meets the dead one's keys. See ``docs/launch.md``.
"""

from ._process_group import init_process_group as init_process_group

__all__ = ["init_process_group"]
