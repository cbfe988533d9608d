"""The layout holds: read from the code's own imports, no layer imports one above it, no
module imports itself back through others, and no module grows past 500 lines.

Layers, bottom to top: ``policies`` -> ``signals`` -> ``compiler`` -> ``xdsserver`` ->
``controlplane`` -> ``api`` -> ``commands``, with no exception. Beside them:

- ``replicasim``, the simulated model server, imports no first-party package, and only
  ``commands``, ``bench`` and the tests import it;
- ``bench`` may import every layer and ``replicasim``; nothing imports ``bench`` (its tests
  aside).

The tests share one harness (``tests/harness`` and the fixtures in ``conftest``): a test
module imports neither another test module nor ``conftest``, and the harness imports no test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("policies", "signals", "compiler", "xdsserver", "controlplane", "api", "commands")
SIMULATOR = "replicasim"
BENCH = "bench"
# replicasim is created beside this layout change; until it lands the graph goes without it.
PACKAGES = (*LAYERS, SIMULATOR, BENCH)
MAY_IMPORT_SIMULATOR = {"commands", BENCH}
MAX_LINES = 500


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
    return LAYERS.index(module.split(".")[0])


def test_the_graph_sees_every_package() -> None:
    assert {module.split(".")[0] for module in GRAPH} == set(PACKAGES)
    assert "policies.models" in GRAPH["compiler.compile"]
    assert "signals.state" in GRAPH["compiler.compile"]


def _wrong_import(module: str, target: str) -> bool:
    """Whether `module` may not import `target` (both first-party modules)."""
    source, top = module.split(".")[0], target.split(".")[0]
    if source == top:
        return False
    if top == BENCH:
        return True
    if source == SIMULATOR:
        return True
    if top == SIMULATOR:
        return source not in MAY_IMPORT_SIMULATOR
    if source == BENCH:
        return False
    return _rank(target) > _rank(module)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_runs_up_a_layer(package: str) -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if module.split(".")[0] == package
        for target in sorted(targets)
        if _wrong_import(module, target)
    ]
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("module", "target", "wrong"),
    [
        ("signals.state", "policies.models", False),
        ("policies.validate", "signals.state", True),
        ("compiler.compile", "signals.live", False),
        ("signals.live", "compiler.plan", True),
        ("xdsserver.snapshot", "compiler.plan", False),
        ("controlplane.reconcile.loop", "api.app", True),
        ("commands.demo", "replicasim.server", False),
        ("commands.demo", "bench.stack", True),
        ("controlplane.local.stack", "replicasim.server", True),
        ("replicasim.server", "policies.models", True),
        ("bench.rig.stack", "commands.serve", False),
        ("bench.rig.stack", "replicasim.server", False),
    ],
)
def test_the_rules_tell_a_wrong_import(module: str, target: str, wrong: bool) -> None:
    assert _wrong_import(module, target) is wrong


def test_no_module_is_over_500_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"modules over {MAX_LINES} lines (split them by idea):\n" + "\n".join(long)


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
