"""The ``d9d`` command starts without ``torch``; its choices are the library's own."""

from __future__ import annotations

import subprocess
import sys

from d9d.cli._options import SCHEDULE_NAMES
from d9d.cli.bench import _cases, _kernels
from d9d.cli.bench._parser import BENCH_DTYPES, BENCH_OPS, BENCH_SHAPES
from d9d.cli.train._parser import FP8_RECIPES
from d9d.transforms.fp8._linear import GRAD_DTYPES
from d9d.transforms.pipeline import SCHEDULES


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_help_and_import_load_neither_torch_nor_the_testing_helpers() -> None:
    loaded = _loaded_after("import d9d.cli._main as m\nm._parser().format_help()")
    assert "torch" not in loaded
    loaded = _loaded_after("import d9d")
    assert not {"torch", "transformers", "triton", "matplotlib", "d9d.testing"} & loaded
    loaded = _loaded_after("import d9d\nd9d.jit")
    assert "torch" in loaded and "d9d.testing" not in loaded and "transformers" not in loaded


def test_the_parser_offers_the_library_choices() -> None:
    assert sorted(SCHEDULE_NAMES) == sorted(SCHEDULES)
    assert tuple(FP8_RECIPES) == tuple(GRAD_DTYPES)
    assert tuple(BENCH_SHAPES) == tuple(_cases.SHAPES)
    assert tuple(BENCH_OPS) == tuple(_cases.OPS)
    assert tuple(BENCH_DTYPES) == tuple(_kernels.DTYPES)


def test_the_plan_command_and_the_transforms_load_no_compiler_backend() -> None:
    """``d9d.core._jit`` brings inductor's ``compile_fx`` (about 2 s): only ``jit`` loads it."""
    loaded = _loaded_after("import d9d.cli.plan._show, d9d.transforms")
    assert not {"d9d.core._jit", "torch._inductor.compile_fx"} & loaded
    loaded = _loaded_after("import d9d.transforms\nprint(d9d.transforms.Jitted)")
    assert {"d9d.core._jit", "torch._inductor.compile_fx"} <= loaded


def test_bad_flags_and_paths_are_answered_before_torch_is_imported() -> None:
    """They came after 4-5 s of imports (torch and the library)."""
    cases = {
        "train --steps 0": "--steps must be >= 1, got 0",
        "train --data /no/such/path": "--data '/no/such/path' does not exist",
        "train --resume-from /no/such/step_4": "--resume-from '/no/such/step_4' does not exist",
        "plan --tp 0": "--tp must be an int >= 1, got 0",
        "plan --hf-config /no/such.json": "--hf-config '/no/such.json' is not a file",
    }
    for argv, message in cases.items():
        code = (
            "import contextlib, io\nfrom d9d.cli import main\nerr = io.StringIO()\n"
            f"with contextlib.redirect_stderr(err):\n    assert main({argv.split()!r}) == 2\n"
            f"assert {message!r} in err.getvalue(), err.getvalue()"
        )
        assert "torch" not in _loaded_after(code), argv


def test_a_subcommand_loads_only_its_own_command_module() -> None:
    """``d9d --help`` loads no subcommand's ``_command``; ``d9d plan`` loads plan's alone."""
    commands = {f"d9d.cli.{name}._command" for name in ("train", "plan", "bench")}
    loaded = _loaded_after("import d9d.cli._main as m\nm._parser().format_help()")
    assert not commands & loaded
    code = (
        "import contextlib, io\nfrom d9d.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n    assert main(['plan', '--tp', '0']) == 2"
    )
    assert commands & _loaded_after(code) == {"d9d.cli.plan._command"}
