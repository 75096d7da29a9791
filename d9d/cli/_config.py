"""The options of ``d9d train``, importable without ``torch`` (the command's ``--help``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``d9d train``; each field is the command-line flag of the same name."""

    preset: str = "tiny"
    model: str = "llama"  # "llama" or "moe" (d9d.models.MoE: aux loss and load in metrics)
    steps: int = 200
    lr: float = 3e-3
    batch_size: int = 16  # sequences per step, over all data-parallel ranks
    seq_len: int = 128
    seed: int = 0
    out: Path = Path("runs/train")
    data: Path | None = None  # None: the Python standard library's own source files
    token_dtype: str = "uint16"  # the ids of a .bin --data file: "uint16" or "uint32"
    vocab_size: int | None = None  # None: the preset's
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    jit: bool = False
    log_every: int = 1
    save_every: int = 0  # steps between checkpoints in out/checkpoints; 0: none
    keep: int | None = None  # newest checkpoints kept; None: all
    resume: bool = False  # continue from the newest readable checkpoint, if there is one
    resume_from: Path | None = None  # continue from this checkpoint folder (implies resume)
    allow_config_change: bool = False  # resume although a schedule or model flag changed
    dp: int | None = None  # ranks the model is replicated over (HSDP/DDP); None: 1
    fsdp: int | None = None  # ranks the model is sharded over; None: the rest of the world
    tp: int | None = None  # tensor-parallel ranks (Megatron TP, sequence parallel); None: 1
    cp: int | None = None  # context-parallel ranks (ring attention); None: 1
    pp: int | None = None  # pipeline stages; None: 1
    ep: int | None = None  # expert-parallel ranks (routed experts sharded; --model moe); None: 1
    schedule: str = "1f1b"  # pipeline schedule, with --pp
    microbatches: int | None = None  # pipeline microbatches per step; None: 2 x pp
    dtype: str = "float32"  # "bfloat16": blocks compute in bf16 over float32 master weights
    opt_state_dtype: str = "float32"  # "bfloat16": AdamW's moments stored in bf16 (math in fp32)
    master_weights: bool = False  # params stored in bf16, float32 masters in the optimizer state
    offload_opt_state: bool = False  # AdamW's state in host memory, updated there
    zero: int = 3  # over --fsdp: 3 params, grads, state sharded; 2 grads, state; 1 state only
    fp8: str | None = None  # fp8 recipe of the linears and routed experts (d9d.fp8); None: off
    fp8_include: tuple[str, ...] = ()  # regexes: only the modules one matches compute in fp8
    fp8_exclude: tuple[str, ...] = ()  # regexes: the modules one matches stay high precision
    fp8_gather: bool = False  # fp8 weights all-gathered as fp8 data + scale (tensorwise, fsdp)
    grad_accum: int = 1  # gradient-accumulation microbatches per step (not with --pp)
    dist_timeout: float = 600.0  # seconds a collective or store wait may block under torchrun
    fault_tolerant: bool = False  # a torchft replica group: train on when another group fails
    lighthouse: str | None = None  # the torchft lighthouse's address, with fault_tolerant
    replica_group_id: int | None = None  # this group's index, 0 .. replica_groups - 1
    replica_groups: int | None = None  # how many groups the global batch is split over
    diloco: int | None = None  # with fault_tolerant: DiLoCo, an outer round every N steps
    diloco_warmup: int = 0  # with diloco: the first steps, each followed by an averaging round
    tensorboard: bool = True  # event files in out/tensorboard, if tensorboard is installed
    wandb: bool = False  # log to Weights & Biases (WANDB_MODE=offline: to out/wandb only)
    wandb_project: str = "d9d"
    eval_every: int = 0  # steps between held-out evaluations; 0: none (and nothing held out)
    eval_fraction: float = 0.01  # share of the token stream held out, with eval_every
    eval_batches: int = 4  # held-out batches per evaluation
    profile: bool = False  # a torch.profiler trace in out/profile
    profile_steps: int = 3  # steps traced, after one warmup step
