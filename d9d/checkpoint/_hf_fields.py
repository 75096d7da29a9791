"""Which ``transformers`` config fields d9d's own models implement, and the refusal of the rest.

The fields checked are those of the ``transformers`` config class itself (a default instance's
``to_dict()``) and of the folder's ``config.json``, not a list kept here: a field that d9d does
not read must stay at the class default, or at the one value d9d implements, else the import
or export raises a ``ConfigError`` naming it. A field ``transformers`` adds later therefore
fails safe: at its default it changes nothing, set otherwise it is refused until d9d reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError

__all__ = ["NO_MATH", "FieldRules", "check_fields"]

NO_MATH: Mapping[str, str] = MappingProxyType(
    {
        "transformers_version": "the version that wrote the folder",
        "architectures": "the class names to load with; the weights decide the model",
        "model_type": "checked before the fields, by the caller",
        "dtype": "the stored dtype; the safetensors hold the values",
        "torch_dtype": "dtype's older name",
        "_name_or_path": "where the folder came from",
        "use_cache": "the key/value cache of generation; a training step holds none",
        "output_hidden_states": "which outputs the forward returns, not their values",
        "output_attentions": "which outputs the forward returns, not their values",
        "return_dict": "the type of the output, not its values",
        "id2label": "labels of a classification head, which a causal LM has not",
        "label2id": "labels of a classification head, which a causal LM has not",
        "problem_type": "the loss of a classification head, which a causal LM has not",
        "bos_token_id": "read by generation and tokenizers, not by the forward",
        "eos_token_id": "read by generation and tokenizers, not by the forward",
        "tokenizer_class": "read by tokenizers, not by the forward",
    }
)
"""``{field: why}`` of the fields that do not change what a causal LM computes or learns."""


@dataclasses.dataclass(frozen=True)
class FieldRules:
    """What a d9d model does with the fields of one ``transformers`` config class.

    Attributes:
        model: The d9d model, for messages (``"the d9d Llama"``).
        model_type: The ``transformers`` family whose config class lists the fields.
        read: ``{field: what d9d does with it}``: fields the d9d config takes over or checks
            itself; any value passes here.
        required: ``{field: value}``: fields d9d implements at this one value only.
    """

    model: str
    model_type: str
    read: Mapping[str, str]
    required: Mapping[str, Any]


def check_fields(hf: Mapping[str, Any], rules: FieldRules) -> dict[str, Any]:
    """``hf`` (a ``config.json`` dict) as ``transformers`` reads it, after refusing every field
    that ``rules.model`` does not implement: not in ``rules.read`` or :data:`NO_MATH`, and
    away from ``rules.required`` or the config class's default.

    ``hf`` goes through the config class first (``from_dict(hf).to_dict()``), so aliases
    (``num_experts``) and older spellings (``rope_theta``) are read as ``transformers`` reads
    them, and a field the folder leaves out takes the class default.

    Returns:
        Every field of the config, under the names and with the defaults of its class.

    Raises:
        ConfigError: A field d9d does not implement has a value that changes the math, a
            field the config class does not know is set, or the class refuses ``hf``. The message names the field, its
            value and what d9d implements.
        ImportError: ``transformers`` is not installed (``pip install 'd9d[hf]'``).
    """
    import transformers

    config_class = transformers.CONFIG_MAPPING[rules.model_type]
    defaults = config_class().to_dict()
    try:
        given = config_class.from_dict(dict(hf)).to_dict()
    # Whatever the class raises (typed fields raise huggingface_hub's StrictDataclassError,
    # which older versions of it do not have) means it does not read the config.
    except Exception as error:
        raise ConfigError(
            f"transformers' {config_class.__name__} does not read this config.json: {error!r}"
        ) from error
    for field in sorted(given):
        if field in rules.read or field in NO_MATH:
            continue
        value = given[field]
        if field in rules.required:
            wanted = rules.required[field]
        elif field in defaults:
            wanted = defaults[field]
        else:
            raise ConfigError(
                f"config.json sets {field}={value!r}, a field {config_class.__name__} does not "
                f"define, so d9d cannot tell what it changes; {rules.model} does not read it. "
                f"Remove it from config.json if it does not change the model, or train the "
                "transformers model itself: d9d.functionalize(AutoModelForCausalLM."
                "from_pretrained(folder))."
            )
        if value != wanted:
            raise ConfigError(
                f"config.json has {field}={value!r}, which {rules.model} does not implement: "
                f"it computes {field}={wanted!r} only. Train the transformers model itself "
                "instead: d9d.functionalize(AutoModelForCausalLM.from_pretrained(folder))."
            )
    return given
