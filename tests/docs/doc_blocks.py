"""The fenced code blocks of README.md and docs/*.md, with the snippet markers above them.

A marker is an HTML comment on the lines right above a fence (invisible once rendered); several
may stack. Forms (docs/testing.md, "Doc snippets"):

    <!-- snippet: ranks=4 -->                run on 4 thread ranks (`fork`: forked processes)
    <!-- snippet: fork -->                   run in one forked process (process-wide side effects)
    <!-- snippet: skip WHY -->               not run, for the stated reason
    <!-- snippet: output -->                 a text block: lines the bash block above prints
    <!-- snippet: file NAME.py -->           not run: saved as NAME.py where the page's bash
                                             blocks below it run (a script they launch)
    <!-- snippet: sub OLD => NEW | WHY -->   run with OLD replaced by NEW (OLD must occur)
    <!-- snippet: setup
    hidden code, run just before the block, where the block runs
    -->
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("python", "bash", "text")

_FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
_MARKER = re.compile(r"^<!-- snippet: (?P<body>.*?)(?: -->)?$")
_SUB = re.compile(r"^sub (?P<old>.+?) =>(?: (?P<new>.*?))? \| .+$")  # the why is required


@dataclass(frozen=True)
class Block:
    """One fenced block and what its markers say about running it."""

    file: str  # path relative to the repository root, e.g. "docs/overview.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    ranks: int = 0  # 0: in this process, in the page's namespace
    fork: bool = False
    skip: str = ""  # the reason, if not run
    output: bool = False  # a text block of what the bash block before it prints
    subs: tuple[tuple[str, str], ...] = ()
    setup: str = ""  # hidden code, its first line at setup_line
    setup_line: int = 0
    script: str = ""  # the file name it is saved as for the bash blocks below it, if any

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def path(self) -> Path:
        return ROOT / self.file

    def source(self) -> str:
        """The code as run: each declared substitution applied (line numbers kept)."""
        code = self.code
        for old, new in self.subs:
            if old not in code:
                raise AssertionError(
                    f"{self.id}: marker `sub {old} => {new}`: {old!r} is not in it"
                )
            code = code.replace(old, new)
        return code


def doc_blocks() -> list[Block]:
    """The blocks of README.md and docs/*.md, page by page."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [b for path in paths for b in parse(path.relative_to(ROOT).as_posix(), path.read_text())]


def parse(file: str, text: str) -> list[Block]:
    """Every fenced block of the page ``file`` holding ``text``, in order, with its markers.

    Raises:
        ValueError: a marker not right above a fence, an unknown marker, an unclosed fence or
            setup comment, or ``ranks`` on a block that is not Python.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    markers: dict[str, Any] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            i = _read_marker(file, lines, i, marker["body"], markers)
            after = lines[i] if i < len(lines) else ""
            if not (_FENCE.match(after) or _MARKER.match(after)):
                raise ValueError(f"{file}:{i + 1}: a snippet marker must be right above a fence")
            continue
        fence = _FENCE.match(line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
            if end is None:
                raise ValueError(f"{file}:{i + 1}: the fence is never closed")
            block = Block(
                file, i + 1, fence["lang"], "\n".join(lines[i + 1 : end]) + "\n", **markers
            )
            if (block.ranks or block.fork or block.script) and block.lang != "python":
                raise ValueError(f"{block.id}: ranks, fork and file apply to Python blocks only")
            if block.output and not (block.lang == "text" and blocks and blocks[-1].lang == "bash"):
                raise ValueError(f"{block.id}: an output block is text right after a bash block")
            blocks.append(block)
            markers = {}
            i = end + 1
            continue
        if line.startswith("<!-- snippet"):
            raise ValueError(f"{file}:{i + 1}: malformed snippet marker {line!r}")
        i += 1
    return blocks


def _read_marker(file: str, lines: list[str], i: int, body: str, markers: dict[str, Any]) -> int:
    """Records the marker starting at line ``i`` into ``markers``; returns the line after it."""
    where = f"{file}:{i + 1}"
    if body == "setup":
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "-->"), None)
        if end is None:
            raise ValueError(f"{where}: the setup comment is never closed by a line `-->`")
        markers["setup"] = "\n".join(lines[i + 1 : end]) + "\n"
        markers["setup_line"] = i + 2
        return end + 1
    if not lines[i].endswith(" -->"):
        raise ValueError(f"{where}: a one-line snippet marker ends with ` -->`")
    if body.split(" ", 1)[0] == "skip":
        markers["skip"] = body.removeprefix("skip").strip()
        if not markers["skip"]:
            raise ValueError(f"{where}: a skip marker says why: `snippet: skip WHY`")
    elif body.startswith("file "):
        name = body.removeprefix("file ").strip()
        if not re.fullmatch(r"[\w-]+\.py", name):
            raise ValueError(f"{where}: a file marker names a Python file: `snippet: file x.py`")
        markers["script"] = name
    elif body.startswith("sub "):
        sub = _SUB.match(body)
        if not sub:
            raise ValueError(f"{where}: a sub marker reads `sub OLD => NEW | WHY`: {lines[i]!r}")
        markers["subs"] = (*markers.get("subs", ()), (sub["old"], sub["new"] or ""))
    else:
        for word in body.split():
            if word == "fork":
                markers["fork"] = True
            elif word == "output":
                markers["output"] = True
            elif re.fullmatch(r"ranks=[1-9][0-9]*", word):
                markers["ranks"] = int(word.removeprefix("ranks="))
            else:
                raise ValueError(f"{where}: unknown snippet marker {word!r} in {lines[i]!r}")
    return i + 1
