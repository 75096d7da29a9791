"""The checks of ``d9d train``'s flags that need neither ``torch`` nor the library: run before
the command imports them (about 5 s), so a bad flag or path is answered at once."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from ...errors import ConfigError, DataError
from .._config import TrainConfig
from .._options import check_fp8_flags, check_offload_flags

__all__ = ["check_flags"]


def check_flags(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the flag when an option is out of range or inconsistent
    with another, or ``DataError`` when ``--data`` or ``--resume-from`` does not exist."""
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_batches", "profile_steps"):
        if getattr(config, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}"
            )
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise ValueError(f"--lr must be a positive number, got {config.lr}")
    if not (config.clip > 0 and math.isfinite(config.clip)):
        raise ValueError(
            f"--clip must be a positive number (the largest global gradient norm), got "
            f"{config.clip}; clipping cannot be turned off: a large --clip leaves it inactive"
        )
    if not (config.weight_decay >= 0 and math.isfinite(config.weight_decay)):
        raise ValueError(f"--weight-decay must be a number >= 0, got {config.weight_decay}")
    if not (config.dist_timeout > 0 and math.isfinite(config.dist_timeout)):
        raise ValueError(
            f"--dist-timeout must be a positive number of seconds, got {config.dist_timeout}"
        )
    if config.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {config.warmup}")
    for name in ("dp", "fsdp", "ep", "tp", "cp", "pp", "microbatches"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(config, name)}")
    defaults = TrainConfig()
    if (config.pp or 1) == 1:
        given = [
            f"--{name} {getattr(config, name)}"
            for name in ("microbatches", "schedule")
            if getattr(config, name) != getattr(defaults, name)
        ]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{' and '.join(given)} only {verb} with --pp (a pipeline's microbatches and "
                "schedule); give --pp ranks, or drop them (accumulation without a pipeline "
                "is --grad-accum)"
            )
    watch_flags = {  # flag: (value, default, the flag it modifies)
        "--eval-fraction": (config.eval_fraction, defaults.eval_fraction, "--eval-every"),
        "--eval-batches": (config.eval_batches, defaults.eval_batches, "--eval-every"),
        "--profile-steps": (config.profile_steps, defaults.profile_steps, "--profile"),
        "--wandb-project": (config.wandb_project, defaults.wandb_project, "--wandb"),
    }
    enabled = {
        "--eval-every": config.eval_every > 0,
        "--profile": config.profile,
        "--wandb": config.wandb,
    }
    for flag, (value, default, needs) in watch_flags.items():
        if value != default and not enabled[needs]:
            raise ValueError(f"{flag} {value} only applies with {needs}; add it, or drop {flag}")
    if config.profile and config.steps < 2:
        raise ValueError(
            f"--profile traces from the second step of a run (the first allocates and "
            f"compiles), and --steps {config.steps} runs none; pass --steps 2 or more"
        )
    if config.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {config.grad_accum}")
    if config.grad_accum > 1 and (config.pp or 1) > 1:
        raise ValueError(
            "--grad-accum does not combine with --pp: a pipeline step already accumulates its "
            "--microbatches; drop --grad-accum and pass --microbatches"
        )
    check_fp8_flags(config.fp8, config.fp8_include, config.fp8_exclude, config.fp8_gather)
    if config.zero not in (1, 2, 3):
        raise ValueError(f"--zero must be 1, 2 or 3, got {config.zero!r}")
    check_offload_flags(
        config.offload_opt_state,
        jit=config.jit,
        master_weights=config.master_weights,
    )
    if config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {config.dtype!r}")
    if config.master_weights and config.dtype != "bfloat16":
        raise ValueError(
            "--master-weights stores the params in bfloat16 and computes in it: pass --dtype "
            "bfloat16 with it"
        )
    if config.model not in ("llama", "moe"):
        raise ValueError(f"--model must be llama or moe, got {config.model!r}")
    if (config.ep or 1) > 1 and config.model != "moe":
        raise ValueError(
            f"--ep {config.ep} shards routed experts, and --model {config.model} has none: "
            "pass --model moe, or use --dp/--fsdp for data parallelism"
        )
    if config.jit and (config.pp or 1) > 1:
        raise ValueError(
            "--jit does not compile a pipeline step (its schedule runs eagerly); drop --jit or --pp"
        )
    if config.eval_every < 0 or not 0 < config.eval_fraction < 1:
        raise ValueError(
            f"--eval-every must be >= 0 and --eval-fraction in (0, 1), got {config.eval_every} "
            f"and {config.eval_fraction}"
        )
    if config.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb needs the wandb package: pip install 'd9d[wandb]'")
    if config.eval_every and (config.pp or 1) > 1:
        raise ValueError(
            "--eval-every does not run with --pp yet (eval has no forward-only schedule); drop one"
        )
    if config.save_every < 0 or (config.keep is not None and config.keep < 1):
        raise ValueError(
            f"--save-every must be >= 0 and --keep >= 1, got {config.save_every} and {config.keep}"
        )
    if config.allow_config_change and not (config.resume or config.resume_from is not None):
        raise ValueError(
            "--allow-config-change only applies with --resume or --resume-from (it lets a "
            "resumed run change a flag that changes the schedule or the model); add one, or "
            "drop it"
        )
    for flag, path in (("--data", config.data), ("--resume-from", config.resume_from)):
        if path is not None and not Path(path).exists():
            what = (
                "a text file, a folder of text files or a .bin token file"
                if flag == "--data"
                else "a checkpoint folder (out/checkpoints/step_N)"
            )
            raise DataError(f"{flag} {str(path)!r} does not exist; pass {what}")
    out = Path(config.out)
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # found after the model was built, as a bare [Errno 17]
        raise ValueError(
            f"--out {str(config.out)!r} cannot be a folder: {str(blocking)!r} is a file; pass "
            "another --out"
        )
    data_folder = config.data is not None and Path(config.data).is_dir()
    if data_folder and not (Path(config.data) / "train.bin").is_file():  # its files are read
        data, out = Path(config.data).resolve(), Path(config.out).resolve()
        if out.is_relative_to(data):
            raise DataError(
                f"--out {str(config.out)!r} is inside --data {str(config.data)!r}: the run's "
                "own outputs (records, checkpoints) would be read as data by a rank that reads "
                "after they are written, a rerun or a --resume; pass an --out outside it"
            )
    _check_fault_tolerance(config)


def _check_fault_tolerance(config: TrainConfig) -> None:
    """``--fault-tolerant``'s flags, and what it does not run with yet (``ConfigError``)."""
    ft_flags = {
        "--lighthouse": config.lighthouse,
        "--replica-group-id": config.replica_group_id,
        "--replica-groups": config.replica_groups,
    }
    if config.diloco is not None and config.diloco < 1:
        raise ValueError(
            f"--diloco H must be >= 1 inner steps per outer round, got {config.diloco}"
        )
    if config.diloco is not None and config.steps % config.diloco:
        raise ValueError(
            f"--steps {config.steps} is not a multiple of --diloco {config.diloco}: the last "
            f"{config.steps % config.diloco} steps would never be averaged, and the replica "
            "groups would end with different params; pass a multiple"
        )
    if config.diloco_warmup and config.diloco is None:
        raise ValueError("--diloco-warmup only applies with --diloco H; add it, or drop it")
    if config.diloco is not None and (
        config.diloco_warmup < 0 or config.diloco_warmup % config.diloco
    ):
        raise ValueError(
            f"--diloco-warmup {config.diloco_warmup} must be >= 0 and a multiple of --diloco "
            f"{config.diloco}, so that outer rounds still come at multiples of it (where "
            "checkpoints are saved)"
        )
    if not config.fault_tolerant:
        given = [
            flag
            for flag, value in {**ft_flags, "--diloco": config.diloco}.items()
            if value is not None
        ]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} only {verb} with --fault-tolerant; add it")
        return
    missing = [flag for flag, value in ft_flags.items() if value is None]
    if missing:
        raise ValueError(f"--fault-tolerant needs {', '.join(missing)} (docs/fault_tolerance.md)")
    if config.replica_groups < 1 or not 0 <= config.replica_group_id < config.replica_groups:
        raise ValueError(
            f"--replica-group-id must be in 0 .. --replica-groups - 1, got "
            f"{config.replica_group_id} of {config.replica_groups}"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ValueError("--fault-tolerant needs the torchft package: pip install 'd9d[ft]'")
    ft = "--fault-tolerant"
    refused = {  # flag: (given, why)
        "--jit": (
            config.jit and config.diloco is None,
            "the quorum and commit vote are host calls each step (--diloco H compiles its "
            "inner steps, between which no group calls another)",
        ),
    }
    for flag, (given, why) in refused.items():
        if given:
            raise ConfigError(f"{ft} does not run with {flag} yet: {why}; drop {flag}")
    if config.model == "moe" and config.diloco is None:
        raise ConfigError(
            f"{ft} does not run with --model moe yet: its expert loads are summed over each "
            "replica group's ranks only, so each group would nudge its router biases by its "
            "own loads and the groups' params would drift apart; add --diloco H (whose outer "
            "rounds average whole params), or drop --fault-tolerant"
        )
    if config.diloco is not None and (config.pp or 1) > 1:
        raise ConfigError(
            "--diloco does not run with --pp yet: no test has run a DiLoCo outer round over "
            "pipeline stages; drop --pp, or --diloco (--fault-tolerant alone runs with --pp)"
        )
    if config.diloco is not None and config.master_weights:
        raise ConfigError(
            "--diloco does not run with --master-weights yet: an outer round replaces the "
            "params with the new anchor, but the optimizer would go on from its float32 "
            "masters, the group's own params before the round, and undo it; drop "
            "--master-weights (--dtype bfloat16 alone computes in bfloat16 with float32 params)"
        )
    if config.diloco is not None and config.save_every % config.diloco:
        raise ConfigError(
            f"--save-every {config.save_every} is not a multiple of --diloco "
            f"{config.diloco}: a DiLoCo group saves right after an outer round, where every "
            "group holds the round's anchor, so that groups resumed from their own "
            f"checkpoints go on together; pass a multiple of {config.diloco}"
        )
