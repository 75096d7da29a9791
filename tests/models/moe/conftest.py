"""``tests/models/moe`` shares the MoE step's one-device reference with ``tests/distributed``
(``moe_steps.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "distributed"))
