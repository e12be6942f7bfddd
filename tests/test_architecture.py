"""The dependency rules of docs/ARCHITECTURE.md, enforced on the source: every module's imports
(top-level and inside functions) are parsed, and a forbidden edge, a forbidden third-party
import, an import circle, an import of another package's private name, an import of a name that
does not exist, or a long file without its reason fails the test.

Each rule is a function that returns what breaks it, run on the tree; and each is shown to
catch a module written to break it (in a small tree under a temporary folder), so no rule can
pass by checking nothing."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "protocol",
    "replica",
    "router",
    "workloads",
    "metrics",
    "autoscaling",
    "sim",
    "cluster",
    "experiments",
    "peers",
    "dashboards",
    "cli",
    "slotserve",
)
OURS = set(PACKAGES) | {"benchmarks", "tests"}

# Which of our packages each package may import (docs/ARCHITECTURE.md, "Packages").
ALLOWED = {
    "protocol": set(),
    "replica": {"protocol"},
    "router": {"protocol"},
    "workloads": {"protocol"},
    "metrics": {"protocol"},
    "autoscaling": {"protocol", "workloads"},
    "sim": {"protocol", "replica", "router", "workloads", "metrics", "autoscaling"},
    "cluster": {"protocol", "replica", "router", "workloads", "metrics", "autoscaling"},
    "experiments": {"protocol", "replica", "router", "workloads", "metrics", "autoscaling", "sim", "cluster"},
    "peers": {"protocol", "replica", "workloads", "metrics"},
    "dashboards": {"protocol", "metrics"},
    "cli": set(PACKAGES) - {"cli", "slotserve"},
    "slotserve": set(PACKAGES) - {"cli", "slotserve"},
}
# Third-party imports a module or package must never make.
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"ray", "torch"},
    "workloads": {"ray", "torch"},
    "router": {"torch"},
    "metrics": {"ray", "torch"},
    "autoscaling": {"ray", "torch"},
    "sim": {"ray"},
    "dashboards": {"ray", "torch"},
    "replica.scheduling": {"ray", "torch"},
    "replica.engine": {"ray"},
    "replica.serving.loop": {"ray"},
    "router.router": {"ray"},
    "router.policies": {"ray"},
    "router.load": {"ray"},
}
# Modules allowed to import Ray in packages that otherwise do not: the Ray actors.
RAY_SHELLS = {"replica.serving.actor", "router.actor"}
MAX_LINES = 400
LONG_FILE_MARK = "# Over 400 lines:"
MARK_WITHIN = 12  # lines from the top
MIN_REASON_WORDS = 3  # "# Over 400 lines:" alone, or with a word or two, gives no reason

Edge = tuple[str, list[str], int]  # (module imported, names taken from it, line)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = ROOT) -> list[Path]:
    return sorted(
        p for pkg in (*PACKAGES, "benchmarks", "tests") if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")
    )


def imports_of(path: Path) -> list[Edge]:
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


def import_graph(root: Path = ROOT) -> dict[str, list[Edge]]:
    """Every module under `root`'s packages -> the imports it makes, resolved to modules."""
    files = source_files(root)
    known = {module_name(p, root) for p in files}
    return {
        module_name(p, root): [
            (t, names, line) for mod, names, line in imports_of(p) for t in resolve(mod, names, known)
        ]
        for p in files
    }


def package(module: str) -> str:
    return module.split(".")[0]


# ---- the rules: each returns what breaks it ----------------------------------------------------


def forbidden_edges(graph: dict[str, list[Edge]]) -> list[str]:
    """Imports of our packages the dependency table does not allow."""
    return [
        f"{mod}:{line} imports {target}"
        for mod, edges in graph.items()
        if package(mod) in ALLOWED
        for target, _, line in edges
        if package(target) in OURS and package(target) != package(mod) and package(target) not in ALLOWED[package(mod)]
    ]


def forbidden_third_party(graph: dict[str, list[Edge]]) -> list[str]:
    """torch or Ray imported where FORBIDDEN_THIRD_PARTY bans it (the Ray actors excepted)."""
    bad = []
    for mod, edges in graph.items():
        if mod in RAY_SHELLS:
            continue
        banned = set().union(*(v for k, v in FORBIDDEN_THIRD_PARTY.items() if mod == k or mod.startswith(k + ".")))
        bad += [f"{mod}:{line} imports {target}" for target, _, line in edges if package(target) in banned]
    return bad


def import_circles(graph: dict[str, list[Edge]]) -> list[list[str]]:
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
    return circles


def private_name_imports(graph: dict[str, list[Edge]]) -> list[str]:
    """`from pkg.mod import _name` across packages: reaching into another package's insides."""
    return [
        f"{mod}:{line} takes {', '.join(n for n in names if n.startswith('_'))} from {target}"
        for mod, edges in graph.items()
        for target, names, line in edges
        if package(target) in OURS
        and package(target) != package(mod)
        and any(n.startswith("_") and not n.startswith("__") for n in names)
    ]


def long_files_without_reason(root: Path = ROOT) -> list[str]:
    """Files over MAX_LINES lines that do not open (within MARK_WITHIN lines) with
    `# Over 400 lines: <why it is one file>`."""
    bad = []
    for path in source_files(root):
        lines = path.read_text().splitlines()
        reasons = [ln[len(LONG_FILE_MARK) :] for ln in lines[:MARK_WITHIN] if ln.startswith(LONG_FILE_MARK)]
        if len(lines) > MAX_LINES and not any(len(r.split()) >= MIN_REASON_WORDS for r in reasons):
            bad.append(f"{path.relative_to(root)}: {len(lines)} lines")
    return bad


def missing_names(files: list[Path], root: Path = ROOT) -> list[str]:
    """`from ours import name` where the module has no such attribute or submodule. Lazy imports
    inside functions run only on their path (a CLI command, a benchmark), so a module moved or a
    name renamed would break them silently."""
    missing = []
    for path in files:
        for target, names, line in imports_of(path):
            if package(target) not in PACKAGES:
                continue
            module = importlib.import_module(target)
            is_package = hasattr(module, "__path__")
            missing += [
                f"{path.relative_to(root)}:{line}: {target}.{n}"
                for n in names
                if not hasattr(module, n) and not (is_package and importlib.util.find_spec(f"{target}.{n}"))
            ]
    return missing


# ---- the rules hold on the tree ----------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    return import_graph()


def test_packages_import_only_what_the_dependency_table_allows(graph):
    """replica and router never import each other, workloads imports nothing of ours but the
    protocol, metrics and sim stay below cluster, and so on down the table."""
    bad = forbidden_edges(graph)
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_no_forbidden_third_party_imports(graph):
    """The scheduler, its policies and the cache bookkeeping import neither torch nor Ray, the
    engine no Ray, the metrics package and the simulator no Ray; only the Ray actors do."""
    bad = forbidden_third_party(graph)
    assert not bad, "forbidden third-party imports:\n" + "\n".join(bad)


def test_no_import_circles_between_modules(graph):
    circles = import_circles(graph)
    assert not circles, f"import circles: {circles}"


def test_no_module_imports_a_private_name_of_another_package(graph):
    bad = private_name_imports(graph)
    assert not bad, "\n".join(bad)


def test_long_files_say_why_at_the_top():
    bad = long_files_without_reason()
    assert not bad, f"files over {MAX_LINES} lines without a '{LONG_FILE_MARK} <reason>' comment at the top: {bad}"


def test_every_name_imported_from_a_project_module_exists():
    missing = missing_names(source_files())
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


# ---- and each rule catches a module written to break it ----------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Our packages' folders under `root`, each with an __init__.py, and `files` (path -> text)."""
    for pkg in PACKAGES:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_imports_are_found_inside_functions_too(tmp_path):
    """The parser sees imports inside functions, so a lazy `import ray` cannot slip through."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import ray\n    from replica.engine import Engine\n")
    assert [(m, n) for m, n, _ in imports_of(path)] == [("ray", []), ("replica.engine", ["Engine"])]


def test_a_forbidden_edge_is_caught(tmp_path):
    """workloads reaching up into cluster and replica into router are reported, with their
    lines; the allowed edge beside them is not."""
    root = write_tree(
        tmp_path,
        {
            "cluster/client.py": "",
            "router/router.py": "",
            "protocol/clock.py": "",
            "workloads/spec.py": "from protocol.clock import Clock\n\n\ndef f():\n    import cluster.client\n",
            "replica/engine.py": "import router.router\n",
        },
    )
    assert forbidden_edges(import_graph(root)) == [
        "replica.engine:1 imports router.router",
        "workloads.spec:5 imports cluster.client",
    ]


def test_a_forbidden_third_party_import_is_caught(tmp_path):
    """torch in the protocol, Ray in the scheduler's package and in the engine are reported; Ray
    in the replica's actor is not."""
    root = write_tree(
        tmp_path,
        {
            "protocol/clock.py": "def f():\n    import torch\n",
            "replica/scheduling/scheduler.py": "from ray.actor import ActorHandle\n",
            "replica/engine.py": "import ray\n",
            "replica/serving/actor.py": "import ray\n",
        },
    )
    assert sorted(forbidden_third_party(import_graph(root))) == [
        "protocol.clock:2 imports torch",
        "replica.engine:1 imports ray",
        "replica.scheduling.scheduler:1 imports ray.actor",
    ]


def test_an_import_circle_is_caught(tmp_path):
    """Three modules importing round in a circle, and a module importing itself; a chain that
    does not close is no circle."""
    root = write_tree(
        tmp_path,
        {
            "sim/a.py": "from sim import b\n",
            "sim/b.py": "import sim.c\n",
            "sim/c.py": "def f():\n    from sim.a import g\n",
            "sim/d.py": "import sim.d\n",
            "sim/e.py": "import sim.a\n",
        },
    )
    assert sorted(import_circles(import_graph(root))) == [["sim.a", "sim.b", "sim.c"], ["sim.d"]]


def test_a_private_name_import_across_packages_is_caught(tmp_path):
    """Another package's `_name` is reported; one's own package's, and dunder names, are not."""
    root = write_tree(
        tmp_path,
        {
            "replica/engine.py": "_SECRET = 1\n",
            "replica/runner.py": "from replica.engine import _SECRET\n",
            "cluster/client.py": "from replica.engine import Engine, _SECRET\nfrom replica import __doc__\n",
        },
    )
    assert private_name_imports(import_graph(root)) == ["cluster.client:1 takes _SECRET from replica.engine"]


def test_a_long_file_without_its_reason_is_caught(tmp_path):
    """Over 400 lines: no mark, a mark with no reason, or a mark below the top are reported; a
    mark with its reason at the top, or a file of 400 lines, is not."""
    body = "x = 1\n" * MAX_LINES
    root = write_tree(
        tmp_path,
        {
            "sim/none.py": body + "y = 2\n",
            "sim/bare.py": f"{LONG_FILE_MARK}\n" + body,
            "sim/late.py": "x = 0\n" * MARK_WITHIN + f"{LONG_FILE_MARK} one schema, one parser, one file.\n" + body,
            "sim/reasoned.py": f'{LONG_FILE_MARK} one schema, one parser, one file.\n"""Doc."""\n' + body,
            "sim/short.py": body,
        },
    )
    assert long_files_without_reason(root) == [
        "sim/bare.py: 401 lines",
        "sim/late.py: 413 lines",
        "sim/none.py: 401 lines",
    ]


def test_an_import_of_a_missing_name_is_caught(tmp_path):
    """A name a project module does not have is reported; an existing name and a submodule
    taken by name are not."""
    path = tmp_path / "uses.py"
    path.write_text("from protocol.clock import FakeClock, NoSuchClock\nfrom protocol import clock\n")
    assert missing_names([path], tmp_path) == ["uses.py:1: protocol.clock.NoSuchClock"]


def test_the_actors_of_a_fake_cluster_start_without_torch():
    """The actors of a fake-replica cluster and the deploy module import neither torch nor
    transformers: each actor is a fresh Ray worker, where those imports cost seconds of CPU."""
    modules = "router.actor, replica.serving.actor, cluster.store_actor, cluster.http.ingress_actor, cluster.deploy"
    heavy = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))"
    code = f"import sys, {modules}; print({heavy})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"imported at start: {out.stdout.strip()[:300]}"
