"""Snippet markers on doc pages: what they attach to a block, and the mistakes they refuse."""

from __future__ import annotations

import pytest
from doc_blocks import parse

PAGE = """Some text.
<!-- snippet: ranks=2 fork -->
<!-- snippet: sub range(200) => range(2) | why it is cheaper -->
<!-- snippet: setup
x = 1
-->
```python
for _ in range(200): pass
```
"""


def test_markers_right_above_a_fence_belong_to_it() -> None:
    [block] = parse("page.md", PAGE)
    assert (block.id, block.lang, block.ranks, block.fork) == ("page.md:7", "python", 2, True)
    assert (block.setup, block.setup_line) == ("x = 1\n", 5)
    assert block.source() == "for _ in range(2): pass\n"


MALFORMED = [
    ("<!-- snippet: ranks=2 -->\n\n```python\n```\n", "must be right above a fence"),
    ("<!-- snippet: rank=2 -->\n```python\n```\n", "unknown snippet marker 'rank=2'"),
    ("<!-- snippet ranks=2 -->\n```python\n```\n", "malformed snippet marker"),
    ("<!-- snippet: sub a => b -->\n```python\n```\n", "a sub marker reads"),
    ("<!-- snippet: skip -->\n```text\n```\n", "a skip marker says why"),
    ("<!-- snippet: ranks=2 -->\n```bash\n```\n", "Python blocks only"),
    ("<!-- snippet: file run.py -->\n```bash\n```\n", "Python blocks only"),
    ("<!-- snippet: file run.sh -->\n```python\n```\n", "a file marker names a Python file"),
    ("<!-- snippet: setup\nx = 1\n```python\n```\n", "never closed by a line `-->`"),
    ("```python\nx = 1\n", "the fence is never closed"),
]


@pytest.mark.parametrize(("text", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_markers_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse("page.md", text)


def test_a_sub_whose_text_is_gone_fails() -> None:
    [block] = parse("page.md", "<!-- snippet: sub range(9) => range(2) | why -->\n```python\n```\n")
    with pytest.raises(AssertionError, match=r"'range\(9\)' is not in it"):
        block.source()


def test_an_output_block_follows_a_bash_block() -> None:
    [bash, output] = parse(
        "p.md", "```bash\nd9d plan\n```\n<!-- snippet: output -->\n```text\nx\n```\n"
    )
    assert output.output and not bash.output
    with pytest.raises(ValueError, match=r"p.md:2: an output block is text right after a bash"):
        parse("p.md", "<!-- snippet: output -->\n```text\nx\n```\n")


def test_a_file_marker_names_the_script_a_bash_block_runs() -> None:
    [script, bash] = parse(
        "p.md",
        "<!-- snippet: file run.py -->\n```python\nprint(1)\n```\n```bash\npython run.py\n```\n",
    )
    assert (script.script, bash.script) == ("run.py", "")
