"""``tests/hf`` reuses the equivalence harness of ``tests/distributed``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
