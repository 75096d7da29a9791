"""The checks of ``d9d plan``'s flags, which need neither ``torch`` nor the library: run
before the command imports them (seconds), so a bad flag or path is answered at once."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["AXES", "DEFAULT_PRESET", "REMAT", "check_layout"]

AXES = ("dp", "fsdp", "ep", "tp", "cp", "pp")
REMAT = ("none", "selective", "full")
DEFAULT_PRESET = "8b"
"""``d9d plan``'s ``--preset`` when none is given."""


def check_layout(
    model: str | None,
    remat: str,
    hf_config: Path | None,
    *,
    preset: str | None = None,
    **axes: Any,
) -> dict[str, int]:
    """The axis sizes ``{pp, dp, fsdp, ep, cp, tp}`` of ``d9d plan``'s flags (``fsdp``: the ranks
    the others leave of ``world``). ``model`` and ``preset`` are None when not given (llama,
    ``DEFAULT_PRESET``).

    Raises:
        ValueError: A flag is out of range, the axes do not make up ``--world``, or
            ``--preset`` or ``--model`` is given with ``--hf-config`` (which names the model).
        FileNotFoundError: ``--hf-config`` is not a file.
    """
    if hf_config is not None and not Path(hf_config).is_file():
        raise FileNotFoundError(f"--hf-config {str(hf_config)!r} is not a file; pass a config.json")
    if hf_config is not None:
        given = [
            f"--{name} {value}"
            for name, value in (("preset", preset), ("model", model))
            if value is not None
        ]
        if given:
            verb, them = ("is", "it") if len(given) == 1 else ("are", "them")
            raise ValueError(
                f"{' and '.join(given)} {verb} not read with --hf-config, whose config.json "
                f"names the model; drop {them}, or drop --hf-config to plan a preset"
            )
    model = model or "llama"
    if model not in ("llama", "moe"):
        raise ValueError(f"--model must be llama or moe, got {model!r}")
    if remat not in REMAT:
        raise ValueError(f"--remat must be one of {', '.join(REMAT)}, got {remat!r}")
    for name, value in axes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an int >= 1, got {value!r}")
    if axes["ep"] > 1 and (model != "moe" or hf_config is not None):
        raise ValueError(
            f"--ep {axes['ep']} shards the routed experts of d9d's MoE model: pass --model moe "
            "(a Hugging Face config's MoE blocks are not expert-parallel yet)"
        )
    others = math.prod(axes[name] for name in AXES if name != "fsdp")
    world, fsdp = axes["world"], axes["fsdp"]
    if fsdp is None:
        if world is not None and world % others:
            raise ValueError(
                f"--world {world} does not split into --dp x --ep x --tp x --cp x --pp = {others} "
                "ranks times an fsdp size; choose axes whose product divides --world"
            )
        fsdp = world // others if world is not None else 1
    if world is not None and others * fsdp != world:
        product = " x ".join(f"--{n} {axes[n] if n != 'fsdp' else fsdp}" for n in AXES)
        raise ValueError(
            f"{product} is {others * fsdp} ranks, not --world {world}; make their product "
            "the world size (or leave --fsdp out to take the rest)"
        )
    return {
        name: fsdp if name == "fsdp" else axes[name]
        for name in ("pp", "dp", "fsdp", "ep", "cp", "tp")
    }
