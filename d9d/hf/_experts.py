"""The routed-experts interface of ``transformers`` 5: what ``expert_parallel`` needs of a
Hugging Face experts module to run it on the rows it dispatches.

``transformers`` holds a family's routed experts as one module (``Qwen3MoeExperts``,
``MixtralExperts``, ..., most decorated with ``@use_experts_implementation``), its params
stacked with a leading expert dim (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
biases ``[E, ...]``), called by the sparse-MoE block as ``experts(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: each token's weighted sum of its
experts' outputs. Its implementations (eager, ``grouped_mm``, ``batched_mm``) read the expert
count from ``num_experts``. A module of that shape can run any subset of its experts on any
rows: its params cut to experts ``a .. b`` with ``num_experts = b - a`` and the ids made
local.
"""

from __future__ import annotations

import inspect

from torch import nn

from ._detect import is_hf_model

__all__ = ["experts_call_names", "experts_interface_refusal", "interface_experts"]

_INTERFACE = "experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])"


def experts_call_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the positional parameters of ``module``'s forward (after ``self``, through
    ``transformers``' decorator); ``()`` if it takes ``*args`` or ``**kwargs``.

    Example:
        >>> experts_call_names(nn.Linear(2, 2))
        ('input',)
    """
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind not in kinds for p in params):
        return ()
    return tuple(p.name for p in params)


def experts_interface_refusal(module: nn.Module, experts: int) -> str | None:
    """Why ``module``, holding ``experts`` routed experts, is not a ``transformers`` experts
    module of the standard interface (see the module docstring), or None if it is.

    Example:
        >>> experts_interface_refusal(nn.Linear(2, 2), 2)
        'Linear is not a transformers module'
    """
    name = type(module).__name__
    if not is_hf_model(module):
        return f"{name} is not a transformers module"
    names = experts_call_names(module)
    if len(names) != 3:
        return f"{name} is called as experts({', '.join(names) or '...'}), not as {_INTERFACE}"
    count = getattr(module, "num_experts", None)
    if count != experts:
        return (
            f"{name}.num_experts is {count!r}, not its {experts} experts, which transformers' "
            "experts implementations read"
        )
    for path, param in module.named_parameters():
        if param.dim() == 0 or param.shape[0] != experts:
            return (
                f"{name}.{path} {tuple(param.shape)} has no leading dim of its {experts} "
                "experts, so that a rank cannot hold a slice of the experts"
            )
    return None


def interface_experts(module: nn.Module) -> dict[str, int]:
    """``{path: E}`` of the submodules of ``module`` that are ``transformers`` experts modules
    of the standard interface (see the module docstring): each holds params of its own, every
    one of them a stack of its ``num_experts`` experts ``E`` on dim 0. What a param is follows
    from its module, not from its name or its logical axes: GPT-OSS's ``down_proj_bias [E, H]``
    is one expert's bias per row, while its router's ``weight [E, H]`` (a module called with
    the tokens alone) is not.

    Example:
        >>> interface_experts(nn.Linear(2, 2))
        {}
    """
    found = {}
    for path, sub in module.named_modules():
        count = getattr(sub, "num_experts", None)
        own = next(sub.parameters(recurse=False), None) is not None
        if own and isinstance(count, int) and experts_interface_refusal(sub, count) is None:
            found[path] = count
    return found
