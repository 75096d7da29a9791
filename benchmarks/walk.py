"""The d9d files one param passes through, from ``step.place`` to its grad's reduce-scatter.

Runs one step of a tiny Llama under ``shard_params`` (fsdp=2) x ``tensor_parallel`` (tp=2) as
rank 0 of a simulated 4-rank world (``d9d.testing.fake_world``: collectives return at once,
so values are meaningless; the calls are the real ones) with a ``sys.setprofile`` hook. A
call into a d9d file is on the param's walk when one of its arguments is the param: its path,
its stored tensor, its plan entry (a dataclass whose ``path`` it is), a tensor of its shape (or a shard's) that a walked function
returned (its gathered copy), or a list, tuple, dict or autograd context holding one of those. The walk ends when
the reduce-scatter that carries its grad is issued. Prints the files in the order entered
(a file entered again after another counts again) and the totals; JSON with ``--out``:

    python benchmarks/walk.py --param layers.0.attn.wq.weight --out benchmarks/results/walk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

import d9d
from d9d.models import Llama, LlamaConfig
from d9d.testing import fake_world

_PACKAGE = str(Path(d9d.__file__).parent)


class _Walk:
    """Follows one param through d9d's calls (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.known: dict[int, Any] = {}  # id -> object (kept alive, so ids stay unique)
        self.files: list[tuple[str, str]] = []  # (file, first function) per stay
        self.done = False
        self.shape: tuple[int, ...] = ()

    def know(self, value: Any) -> None:
        self.known[id(value)] = value

    def _holds(self, value: Any, depth: int = 0) -> bool:
        if isinstance(value, str):
            return value == self.path
        if id(value) in self.known:
            return True
        if "path" in getattr(type(value), "__dataclass_fields__", ()):
            return value.path == self.path
        if depth >= 2:
            return False
        if isinstance(value, dict):
            return any(self._holds(v, depth + 1) or k == self.path for k, v in value.items())
        if isinstance(value, list | tuple | set | frozenset):
            return any(self._holds(v, depth + 1) for v in value)
        if isinstance(value, torch.autograd.function.BackwardCFunction):
            return any(self._holds(v, depth + 1) for v in vars(value).values())
        return False

    def _on_walk(self, frame: types.FrameType) -> bool:
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        return any(self._holds(frame.f_locals.get(n)) for n in names)

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        file = frame.f_code.co_filename
        if event == "call" and "reduce_scatter" in frame.f_code.co_name and self._on_walk(frame):
            self.done = True
            return
        if event == "call" and _is_collective_op(frame, "reduce_scatter") and self._grad_frames():
            self.done = True
            return
        if not file.startswith(_PACKAGE):
            return
        if event == "call" and self._on_walk(frame):
            relative = "d9d/" + Path(file).relative_to(_PACKAGE).as_posix()
            if not self.files or self.files[-1][0] != relative:
                self.files.append((relative, frame.f_code.co_qualname))
        elif event == "return" and arg is not None and self._on_walk(frame):
            self._learn(arg)

    def _learn(self, value: Any) -> None:
        """Take the tensors a walked function returned for the param as the param."""
        if isinstance(value, torch.Tensor) and self._shaped_like(value):
            self.know(value)
        elif isinstance(value, dict) and isinstance(value.get(self.path), torch.Tensor):
            self.know(value[self.path])
        elif isinstance(value, tuple):
            for item in value:
                self._learn(item)

    def _shaped_like(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has the param's shape, or that of a shard of it."""
        if tensor.ndim != len(self.shape):
            return False
        return all(m and n % m == 0 for n, m in zip(self.shape, tensor.shape, strict=True))

    def _grad_frames(self) -> bool:
        """Whether a walked function of d9d, in a backward, is on the stack."""
        frame = sys._getframe(2)
        while frame is not None:
            if (
                frame.f_code.co_filename.startswith(_PACKAGE)
                and frame.f_code.co_name == "backward"
                and self._on_walk(frame)
            ):
                return True
            frame = frame.f_back
        return False


def _is_collective_op(frame: types.FrameType, name: str) -> bool:
    """A call of torch's op wrapper (``torch._ops``) for the collective ``name``."""
    if not frame.f_code.co_filename.endswith("torch/_ops.py") or frame.f_code.co_name != "__call__":
        return False
    return name in str(frame.f_locals.get("self", ""))


def walk(path: str) -> list[tuple[str, str]]:
    """``[(file, function first entered), ...]`` of ``path``'s walk, in order."""
    with fake_world(4):
        torch.manual_seed(0)
        mesh = d9d.make_mesh("cpu", fsdp=2, tp=2)
        model = d9d.functionalize(Llama(LlamaConfig.tiny()))
        opt = d9d.optim.sgd(0.1)

        @d9d.shard_params(mesh, axis="fsdp")
        @d9d.tensor_parallel(mesh, axis="tp")
        def step(params, opt_state, batch):
            def loss_fn(p):
                logits = model.apply(p, batch["tokens"])
                return d9d.losses.cross_entropy(logits, batch["labels"])

            loss, grads = d9d.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

        tokens = torch.randint(0, model.module.config.vocab_size, (2, 9))
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
        opt_state = opt.init(model.params)
        tracer = _Walk(path)
        tracer.know(model.params[path])
        tracer.shape = tuple(model.params[path].shape)
        sys.setprofile(tracer.profile)
        try:
            params, opt_state = step.place(model.params, opt_state, model=model)
            step(params, opt_state, batch)
        finally:
            sys.setprofile(None)
        if not tracer.done:
            raise RuntimeError(f"the walk of {path!r} never reached its grad's reduce-scatter")
        return tracer.files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--param", default="layers.0.attn.wq.weight")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stays = walk(args.param)
    for i, (file, function) in enumerate(stays, 1):
        print(f"{i:>3}. {file:<50} {function}")
    files = [f for f, _ in stays]
    again = sorted({f for f in files if files.count(f) > 1})
    print(f"{len(set(files))} files, {len(files)} stays; entered again after another: {again}")
    if args.out is not None:
        report = {"param": args.param, "stays": stays, "files": len(set(files)), "again": again}
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
