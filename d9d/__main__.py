"""``python -m d9d``: the ``d9d`` command."""

import sys

from .cli import main

sys.exit(main())
