"""Every fenced block of README.md and docs/*.md runs, or says why not (docs/testing.md).

Python blocks of one page run in order in one namespace per page, so a block may use the names
of the blocks above it; a block on ranks (or forked) runs on a copy of that namespace and leaves
no names behind. Bash blocks run in a temporary folder; their install commands and the test
command are compared with `.ci/run`, which is what CI runs, instead of being run.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from doc_blocks import LANGUAGES, ROOT, Block, doc_blocks, parse

from d9d.testing import run_on_ranks

BLOCKS = doc_blocks()
MAX_SKIPPED = 6  # each one listed, with its reason, in docs/testing.md


def _param(block: Block) -> Any:
    marks = [pytest.mark.distributed] if block.ranks > 1 else []
    return pytest.param(block, id=f"{block.id}-{block.lang}", marks=marks)


def test_every_block_runs_or_says_why_not() -> None:
    unknown = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"blocks need a language of {LANGUAGES}: {unknown}"
    silent = [b.id for b in BLOCKS if b.lang == "text" and not (b.skip or b.output)]
    assert not silent, (
        f"```text blocks are not run: mark each `snippet: output` or `snippet: skip REASON`: "
        f"{silent}"
    )
    skipped = [f"{b.id} ({b.skip})" for b in BLOCKS if b.skip]
    assert len(skipped) <= MAX_SKIPPED, f"{len(skipped)} blocks are skipped: {skipped}"
    unused = [
        f"{b.id} ({b.script})"
        for b in BLOCKS
        if b.script
        and not any(
            b in _scripts_above(x) for x in BLOCKS if x.lang == "bash" and b.script in x.code
        )
    ]
    assert not unused, f"`snippet: file` blocks that no bash block below them runs: {unused}"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block(
    block: Block,
    pages: dict[str, _Page],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    if block.script:  # the bash blocks that launch it run it
        compile(block.source(), f"{block.id} ({block.script})", "exec")
        return
    if block.lang == "bash":
        _bash_stdout(block)
        return
    if block.output:
        _check_output(block)
        return
    if block.lang != "python":
        pytest.fail(f"{block.id}: a ```{block.lang} block is not run; mark it skip with a reason")
    page = _page_before(block, pages, tmp_path_factory, monkeypatch)
    try:
        _run(block, page)
    except Exception:  # not pytest's skip: a skipped block on ranks leaves no names anyway
        page.failed = block.id
        raise
    page.done += 1


def test_install_and_test_commands_are_checked_against_ci_not_run() -> None:
    [train, tests] = [b for b in BLOCKS if b.file == "README.md" and b.lang == "bash"]
    assert _script(train) == "d9d train --preset tiny --steps 3"
    assert _script(tests) == ""
    [other] = parse("README.md", "```bash\npip install torch==2.12.0 && d9d plan\n```\n")
    with pytest.raises(AssertionError, match=r"`pip install torch==2.12.0` is not in .ci/run"):
        _script(other)


# --- Python -------------------------------------------------------------------------------------


@dataclass
class _Page:
    """The namespace of one page's Python blocks, as far as they have run in this process."""

    folder: Path  # the working directory of its blocks
    namespace: dict[str, Any]  # the globals of a module in sys.modules (Dynamo imports it)
    done: int = 0  # how many of the page's Python blocks have run
    failed: str = ""  # the block that raised, if one did


def _module(name: str, names: dict[str, Any]) -> dict[str, Any]:
    """The globals of a new module ``name`` in ``sys.modules``, holding ``names``: Dynamo reads
    a traced function's globals by importing the module its ``__name__`` names."""
    module = types.ModuleType(name)
    module.__dict__.update({**names, "__name__": name})
    sys.modules[name] = module
    return module.__dict__


@pytest.fixture(scope="module")
def pages() -> Iterator[dict[str, _Page]]:
    pages: dict[str, _Page] = {}
    yield pages
    for page in pages.values():
        sys.modules.pop(page.namespace["__name__"], None)


def _page_before(
    block: Block,
    pages: dict[str, _Page],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> _Page:
    """The page's namespace with every Python block above ``block`` run (each once per process:
    under pytest-xdist a page's blocks may be split between workers)."""
    python = [b for b in BLOCKS if b.file == block.file and b.lang == "python"]
    index = python.index(block)
    page = pages.get(block.file)
    if page is None or page.done > index:
        torch.manual_seed(0)
        name = "snippets_" + re.sub(r"\W", "_", block.file)
        page = pages[block.file] = _Page(tmp_path_factory.mktemp(name), _module(name, {}))
    if page.failed:
        pytest.fail(f"{block.id} builds on the blocks above it, and {page.failed} failed")
    monkeypatch.chdir(page.folder)
    for earlier in python[page.done : index]:
        if not (earlier.skip or earlier.ranks or earlier.fork or earlier.script):  # no names
            _run(earlier, page)
        page.done += 1
    return page


def _codes(block: Block) -> list[CodeType]:
    """The setup and the block, compiled at their lines of the page (tracebacks show them)."""
    codes = []
    if block.setup:
        codes.append(compile("\n" * (block.setup_line - 1) + block.setup, block.path, "exec"))
    codes.append(compile("\n" * block.line + block.source(), block.path, "exec"))
    return codes


def _run_on_rank(codes: list[CodeType], names: dict[str, Any]) -> None:
    """Runs ``codes`` in a copy of ``names``, as a module of this rank's own."""
    name = f"{names['__name__']}_rank{dist.get_rank()}"
    namespace = _module(name, names)
    try:
        for code in codes:
            exec(code, namespace)
    finally:
        del sys.modules[name]


def _run(block: Block, page: _Page) -> None:
    if not (block.ranks or block.fork):
        for code in _codes(block):
            exec(code, page.namespace)
        return
    if torch.cuda.is_available():
        pytest.skip(f"{block.id}: runs on CPU gloo ranks; make_mesh() would pick CUDA here")
    method = "fork" if block.fork else "thread"
    rank = functools.partial(_run_on_rank, _codes(block), page.namespace)
    run_on_ranks(rank, block.ranks or 1, method=method, timeout=300)


# --- bash ---------------------------------------------------------------------------------------

_INSTALL = re.compile(r"^(python3 -m venv |\. |pip install )")
_TEST = "python -m pytest "


def _ci_commands() -> list[str]:
    """The commands of `.ci/run`, written as the README writes them: `pip` for `python -m pip`,
    no `-q`, `.venv` for the temporary `$venv`."""
    commands = []
    for line in (ROOT / ".ci/run").read_text().splitlines():
        line = re.sub(r'"\$venv([^"]*)"', r".venv\1", line.strip())
        line = re.sub(r"^python -m pip install -q ", "pip install ", line)
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def _script(block: Block) -> str:
    """The block's commands to run, after checking its install and test commands against
    `.ci/run` (CI runs those; the test does not reinstall the project)."""
    ci = _ci_commands()
    # The training quickstart installs without extras: CI's editable install, extras dropped.
    installs = {*ci, *(re.sub(r' -e "\.\[[^]]*\]"$', " -e .", c) for c in ci)}
    tests = [c for c in ci if c.startswith(_TEST)]
    script = []
    for line in block.source().splitlines():
        run = []
        for command in line.strip().split(" && "):
            if _INSTALL.match(command):
                assert command in installs, f"{block.id}: `{command}` is not in .ci/run: {ci}"
            elif command.startswith(_TEST):
                assert [command] == tests, f"{block.id}: `{command}` is not .ci/run's {tests}"
            else:
                run.append(command)
        script.append(" && ".join(run))
    return "\n".join(script)


@functools.cache
def _bash_stdout(block: Block) -> str:
    """What the block prints, run once in a temporary folder of its own."""
    if any(s.script in block.code for s in _scripts_above(block)) and torch.cuda.is_available():
        pytest.skip(f"{block.id}: its script would take a GPU per rank; CI runs it on CPU")
    with tempfile.TemporaryDirectory(prefix="d9d-doc-bash-") as folder:
        return _run_bash(block, Path(folder))


def _check_output(block: Block) -> None:
    """Each line of an output block (but `...`, which elides lines) is a line the bash block
    above it prints, in order."""
    [bash] = [
        b for b in BLOCKS if b.file == block.file and b.lang == "bash" and b.line < block.line
    ][-1:]
    printed = [line.rstrip() for line in _bash_stdout(bash).splitlines()]
    at = 0
    for line in block.code.splitlines():
        if line.strip() in ("", "...") or line == bash.code.strip():
            continue
        found = next((i for i in range(at, len(printed)) if printed[i] == line.rstrip()), None)
        assert found is not None, (
            f"{block.id}: {line!r} is not printed by {bash.id} (after line {at})"
        )
        at = found + 1


def _scripts_above(block: Block) -> list[Block]:
    """The page's `snippet: file` blocks above ``block``: the files its folder holds."""
    return [b for b in BLOCKS if b.file == block.file and b.script and b.line < block.line]


def _run_bash(block: Block, folder: Path) -> str:
    script = _script(block)
    if not script.strip():
        return ""
    for saved in _scripts_above(block):
        (folder / saved.script).write_text(saved.source())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.setup + script],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}:\n{script}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )
    return done.stdout
