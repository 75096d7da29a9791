"""The import graph of ``d9d``: no cycle, and no layer importing one above it.

Read from the source (``ast``), not by importing: every ``import`` and ``from ... import``
inside ``d9d`` counts, at module level, in a function or under ``if TYPE_CHECKING:`` (a
type-only import is a dependency too: a circle of types is still a circle). A contributor who
adds a back edge sees the cycle or the layer it breaks named here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import d9d

ROOT = Path(d9d.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The core's base sub-layer: checks and helpers the kernels and libraries may use too.
CORE_BASE = (
    "d9d.core._mesh",
    "d9d.core._mesh_hash",
    "d9d.core._comm_count",
    "d9d.core._batch_check",
    "d9d.core._index_checks",
    "d9d.core._embedding_ids",
    "d9d.core._grad_mode",
    "d9d.core._shard_rows",
)
# Every module of d9d/core/, its base included, read off the folder: a new one is covered here
# without an entry.
CORE = tuple(sorted(_module_name(p) for p in (ROOT / "core").glob("*.py")))
# A module may import modules of its own layer and of the layers before it, never after.
LAYERS = (
    ("base", ("d9d.errors", "d9d.tree", *CORE_BASE)),
    ("kernels", ("d9d.kernels", "d9d.parallel")),
    ("model rules", ("d9d.hf",)),  # functionalize (core) picks a Hugging Face family's rules
    ("core", ("d9d.core",)),
    ("libraries", ("d9d.losses", "d9d.optim", "d9d.moe", "d9d.models", "d9d.data")),
    ("transforms", ("d9d.transforms",)),
    ("tools", ("d9d.checkpoint", "d9d.testing", "d9d.launch")),
    ("command", ("d9d.cli", "d9d.__main__")),
)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "d9d":
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"module {module} is in no layer of tests/core/test_layering.py")


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_no_import_cycle_inside_d9d() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if _is_package_of(node, target):  # a package re-exporting its own modules
                continue
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_layer_imports_a_layer_above_it() -> None:
    back_edges = []
    for module, targets in sorted(_graph().items()):
        if module == "d9d":
            continue
        for target in sorted(targets):
            if _is_package_of(module, target):
                continue
            if _layer(target) > _layer(module):
                back_edges.append(
                    f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                    f"({LAYERS[_layer(target)][0]})"
                )
    assert not back_edges, "\n".join(back_edges)


def test_core_never_names_a_transform() -> None:
    """The core calls runtimes through the protocol: no core module imports a transform."""
    graph = _graph()
    for module in CORE:
        assert not any(t.startswith("d9d.transforms") for t in graph[module]), module


TRANSFORM_NAMES = (
    "shard_params",
    "tensor_parallel",
    "context_parallel",
    "pipeline",
    "remat",
    "expert_parallel",
    "fp8",
)


def _code_names(tree: ast.Module) -> set[str]:
    """Every name the code binds, reads or imports: variables, attributes, functions,
    classes, arguments, keywords and module paths (not docstrings, comments or messages)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        match node:
            case ast.Name(id=name) | ast.Attribute(attr=name) | ast.arg(arg=name):
                names.add(name)
            case ast.FunctionDef(name=name) | ast.ClassDef(name=name):
                names.add(name)
            case ast.keyword(arg=str() as name):
                names.add(name)
            case ast.alias(name=name, asname=asname):
                names.update(n for n in (name, asname) if n)
            case ast.ImportFrom(module=str() as name):
                names.add(name)
    return names


def test_core_code_holds_no_transform_name() -> None:
    """No core module's code names a transform (its messages may, as advice to the user):
    what serves one transform lives in that transform's package."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    found = []
    for module in CORE:
        names = _code_names(ast.parse(files[module].read_text()))
        found += [
            f"{module}: {name}"
            for name in sorted(names)
            if any(t in name.lower() for t in TRANSFORM_NAMES)
        ]
    assert not found, "\n".join(found)
