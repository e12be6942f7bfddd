"""The dependency rules of docs/ARCHITECTURE.md, enforced on the source: every module's imports
(top-level and inside functions) are parsed, and a forbidden edge, an import circle, an import
of another package's private name, or a long file without a reason fails the test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "protocol",
    "replica",
    "router",
    "workloads",
    "metrics",
    "sim",
    "cluster",
    "experiments",
    "peers",
    "dashboards",
    "cli",
)
OURS = set(PACKAGES) | {"benchmarks", "tests"}

# Which of our packages each package may import (docs/ARCHITECTURE.md, "Packages").
ALLOWED = {
    "protocol": set(),
    "replica": {"protocol"},
    "router": {"protocol"},
    "workloads": {"protocol"},
    "metrics": {"protocol"},
    "sim": {"protocol", "replica", "router", "workloads", "metrics"},
    "cluster": {"protocol", "replica", "router", "workloads", "metrics"},
    "experiments": {"protocol", "replica", "router", "workloads", "metrics", "sim", "cluster"},
    "peers": {"protocol", "replica", "workloads", "metrics"},
    "dashboards": {"protocol", "metrics"},
    "cli": set(PACKAGES) - {"cli"},
}
# Third-party imports a module or package must never make.
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"ray", "torch"},
    "workloads": {"ray", "torch"},
    "router": {"torch"},
    "metrics": {"ray", "torch"},
    "sim": {"ray"},
    "dashboards": {"ray", "torch"},
    "replica.scheduling.scheduler": {"ray", "torch"},
    "replica.scheduling.policies": {"ray", "torch"},
    "replica.scheduling.slot_table": {"ray", "torch"},
    "replica.scheduling.block_manager": {"ray", "torch"},
    "replica.scheduling.request": {"ray", "torch"},
    "replica.engine": {"ray"},
    "replica.serving.loop": {"ray"},
    "router.router": {"ray"},
    "router.policies": {"ray"},
    "router.load": {"ray"},
}
# Modules allowed to import Ray in packages that otherwise do not: the thin actor shells.
RAY_SHELLS = {"replica.serving.actor", "router.actor"}
MAX_LINES = 400
LONG_FILE_MARK = "# Over 400 lines:"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for pkg in (*PACKAGES, "benchmarks", "tests") for p in (ROOT / pkg).rglob("*.py"))


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def resolve(module: str, names: list[str], known: set[str]) -> list[str]:
    """The project modules an import reaches: `from cli import common` is the module cli.common."""
    targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
    return targets or [module]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, list[str], int]]]:
    files = source_files()
    known = {module_name(p) for p in files}
    return {
        module_name(p): [(t, names, line) for mod, names, line in imports_of(p) for t in resolve(mod, names, known)]
        for p in files
    }


def package(module: str) -> str:
    return module.split(".")[0]


def test_packages_import_only_what_the_dependency_table_allows(graph):
    """replica and router never import each other, workloads imports nothing of ours but the
    protocol, metrics and sim stay below cluster, and so on down the table."""
    bad = [
        f"{mod}:{line} imports {target}"
        for mod, edges in graph.items()
        if package(mod) in ALLOWED
        for target, _, line in edges
        if package(target) in OURS and package(target) != package(mod) and package(target) not in ALLOWED[package(mod)]
    ]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_no_forbidden_third_party_imports(graph):
    """The scheduler, its policies and the cache bookkeeping import neither torch nor Ray, the
    engine no Ray, the metrics package and the simulator no Ray; only the actor shells do."""
    bad = []
    for mod, edges in graph.items():
        if mod in RAY_SHELLS:
            continue
        banned = set().union(*(v for k, v in FORBIDDEN_THIRD_PARTY.items() if mod == k or mod.startswith(k + ".")))
        bad += [f"{mod}:{line} imports {target}" for target, _, line in edges if package(target) in banned]
    assert not bad, "forbidden third-party imports:\n" + "\n".join(bad)


def test_no_import_circles_between_modules(graph):
    """Tarjan's strongly connected components over every project import: any component of
    more than one module (or a module importing itself) is a circle."""
    nodes = set(graph)
    edges = {m: sorted({t for t, _, _ in graph[m] if t in nodes}) for m in graph}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                circles.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_module_imports_a_private_name_of_another_package(graph):
    """`from pkg.mod import _name` across packages reaches into another package's insides."""
    bad = [
        f"{mod}:{line} takes {', '.join(n for n in names if n.startswith('_'))} from {target}"
        for mod, edges in graph.items()
        for target, names, line in edges
        if package(target) in OURS
        and package(target) != package(mod)
        and any(n.startswith("_") and not n.startswith("__") for n in names)
    ]
    assert not bad, "\n".join(bad)


def test_long_files_say_why_at_the_top():
    """A file over 400 lines opens (within its first 12 lines) with a comment saying why it is one file."""
    bad = []
    for path in source_files():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(ln.startswith(LONG_FILE_MARK) for ln in lines[:12]):
            bad.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not bad, f"files over {MAX_LINES} lines without a '{LONG_FILE_MARK} ...' comment at the top: {bad}"


def test_the_rules_catch_a_forbidden_edge(tmp_path):
    """The parser sees imports inside functions too, so a lazy `import ray` cannot slip through."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import ray\n    from replica.engine import Engine\n")
    assert [(m, n) for m, n, _ in imports_of(path)] == [("ray", []), ("replica.engine", ["Engine"])]


def test_every_name_imported_from_a_project_module_exists():
    """Lazy imports inside functions run only on their path (a CLI command, a benchmark), so a
    module moved or a name renamed would break them silently: each `from ours import name`
    must name an attribute or a submodule that exists."""
    import importlib

    missing = []
    for path in source_files():
        for target, names, line in imports_of(path):
            if package(target) not in PACKAGES:
                continue
            module = importlib.import_module(target)
            is_package = hasattr(module, "__path__")
            missing += [
                f"{path.relative_to(ROOT)}:{line}: {target}.{n}"
                for n in names
                if not hasattr(module, n) and not (is_package and importlib.util.find_spec(f"{target}.{n}"))
            ]
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
