"""torch's C++ warnings kept out of a command's output.

c10 prints its warnings (``TORCH_WARN``) straight to file descriptor 2, as lines like
``[rank0]:[W1125 18:39:14.549760251 ProcessGroup.hpp:1006] Warning: No backend of type 0
found for Process Group ...``: ``d9d plan``'s simulated ranks raise such notes about torch's own
internals, which say nothing to the user and came before the plan's table.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["native_warnings_dropped"]

_NATIVE_WARNING = re.compile(r"^(\[rank\d+\]:)?\[W\d{4} [\d:.]+ [^\]]+\] ")


@contextmanager
def native_warnings_dropped() -> Iterator[None]:
    """While the block runs, standard error is held back; afterwards (also when the block
    raised) every line of it is written out except torch's C++ warnings."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _NATIVE_WARNING.match(line)))
            sys.stderr.flush()
