"""Hugging Face models without homework: logical axes from ``transformers``' own tp plans.

``d9d.functionalize(hf_model)`` picks its rules from here by itself (see :func:`axes_for`);
rules passed with ``axes=`` win over them. ``Model.apply`` of a ``transformers`` model returns
what its forward returns, an output object: take ``.logits``. Nothing here imports
``transformers``. The guide is ``docs/huggingface.md``.
"""

from ._families import FAMILIES as FAMILIES
from ._families import FILL as FILL
from ._families import POSITION_WISE as POSITION_WISE
from ._families import ROUTERS as ROUTERS
from ._pp_plan import block_lists_for as block_lists_for
from ._rules import apply_defaults as apply_defaults
from ._rules import axes_for as axes_for
from ._rules import family_of as family_of
from ._rules import is_hf_model as is_hf_model
from ._rules import position_wise_for as position_wise_for
from ._tp_plan import IMPLEMENTED_STYLES as IMPLEMENTED_STYLES
from ._tp_plan import plan_rules as plan_rules

__all__ = [
    "FAMILIES",
    "FILL",
    "IMPLEMENTED_STYLES",
    "POSITION_WISE",
    "ROUTERS",
    "apply_defaults",
    "axes_for",
    "block_lists_for",
    "family_of",
    "is_hf_model",
    "plan_rules",
    "position_wise_for",
]
