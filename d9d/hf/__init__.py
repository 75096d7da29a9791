"""Hugging Face models without homework: the logical axes of the families users train.

``d9d.functionalize(hf_model)`` picks its rules from here by itself (see :func:`axes_for`);
rules passed with ``axes=`` win over them. ``Model.apply`` of a ``transformers`` model returns
what its forward returns, an output object: take ``.logits``. Nothing here imports
``transformers``. The guide is ``docs/huggingface.md``.
"""

from ._families import FAMILIES as FAMILIES
from ._rules import axes_for as axes_for
from ._rules import family_of as family_of
from ._rules import is_hf_model as is_hf_model

__all__ = ["FAMILIES", "axes_for", "family_of", "is_hf_model"]
