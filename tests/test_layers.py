"""The layout holds: read from the code's own imports, no layer imports one above it, and no
module imports itself back through others.

Layers, bottom to top: ``policies`` -> ``xdsserver`` -> ``controlplane`` -> ``api`` ->
``commands``. ``bench`` stands beside the commands: it may use every layer below them and the
daemon's composition root (``commands.serve``, which its control-plane benchmark starts with
an ACK log), and only the demo may import it.

The tests share one harness (``tests/harness`` and the fixtures in ``conftest``): a test
module imports neither another test module nor ``conftest``, and the harness imports no test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("policies", "xdsserver", "controlplane", "api", "commands")
PACKAGES = (*LAYERS, "bench")
ALLOWED_EXTRA: dict[str, set[str]] = {
    # (importing package) -> modules above it that it may still import
    "bench": {"commands.serve"},
}
MAY_IMPORT_BENCH = {"commands.demo"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every first-party module `path` imports, wherever the import statement stands."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    modules = {_module_name(path): path for path in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # `from pkg import name` names a module when pkg/name.py exists, else something
            # defined in pkg: keep the longest prefix that is a module.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


GRAPH = _graph()


def _rank(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def test_the_graph_sees_every_package() -> None:
    assert {module.split(".")[0] for module in GRAPH} == set(PACKAGES)
    assert "policies.models" in GRAPH["compiler.compile"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_runs_up_a_layer(package: str) -> None:
    wrong = []
    for module, targets in GRAPH.items():
        if module.split(".")[0] != package:
            continue
        for target in sorted(targets):
            top = target.split(".")[0]
            if top == "bench":
                if package != "bench" and module not in MAY_IMPORT_BENCH:
                    wrong.append(f"{module} -> {target}")
            elif _rank(target) > _rank(module) and target not in ALLOWED_EXTRA.get(package, ()):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over module imports: every one is a single
    module. A package's ``__init__`` re-exporting its modules counts as a module like any
    other, so a submodule importing its own package is a cycle too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


TESTS = ROOT / "tests"


def _test_imports(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports (absolute imports only: the tests
    directory is not a package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_test_modules_share_the_harness_and_import_no_other_test() -> None:
    test_modules = {path.stem for path in TESTS.glob("test_*.py")}
    wrong = []
    for path in sorted([*TESTS.glob("test_*.py"), *(TESTS / "harness").glob("*.py")]):
        for name in sorted(_test_imports(path) & (test_modules | {"conftest"})):
            wrong.append(f"{path.relative_to(ROOT)} -> {name}")
    assert not wrong, (
        "test modules import one another (move the helper to tests/harness):\n" + "\n".join(wrong)
    )
