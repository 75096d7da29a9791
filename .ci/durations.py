"""Write ``tests/durations.json`` from a pytest JUnit XML report: the seconds of every test
that took at least one, the order ``tests/conftest.py`` runs tests in (longest first).

    python -m pytest -q -n 2 --junitxml=/tmp/junit.xml && python .ci/durations.py /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).parents[1] / "tests" / "durations.json"


def node_id(case: ET.Element) -> str:
    """``tests/a/test_b.py::test_c[x]`` from a JUnit ``testcase`` (classname ``tests.a.test_b``)."""
    module, _, cls = case.get("classname", "").partition(".Test")
    path = module.replace(".", "/") + ".py"
    return "::".join([path, *(["Test" + cls] if cls else []), case.get("name", "")])


def main(junit: str) -> None:
    cases = ET.parse(junit).getroot().iter("testcase")
    seconds = {node_id(c): round(float(c.get("time", 0)), 1) for c in cases}
    slow = dict(sorted(((k, v) for k, v in seconds.items() if v >= 1.0), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(slow, indent=1) + "\n")
    print(f"{OUT}: {len(slow)} tests of at least 1 s, {sum(slow.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
