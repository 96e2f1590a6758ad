"""The layers hold: no import cycle among sidecar/, transport/ and adapters/ modules; transport/ never
imports sidecar; adapters/ never import sidecar.daemon; transport/ touches the process environment in
transport/process_env.py only.

Counted: every import, at module level or inside a function: a lazy import hides a cycle from the
interpreter, not from the reader, and the two modules still cannot be understood one without the other.
Imports under ``if TYPE_CHECKING:`` count too: an annotation that names another module's class ties the two
files together for the reader as much as an executed import does. ``from pkg import name`` counts as
importing ``pkg.name`` when that is a module, else ``pkg``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sidecar", "transport", "adapters")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(node: ast.AST):
    """Every import in the tree below ``node``, ``if TYPE_CHECKING:`` blocks included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _imports(child)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            for alias in node.names:
                deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        deps.discard(name)
        deps.intersection_update(mods)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    """Every module can be read bottom-up: no set of modules imports one another in a ring."""
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (break each by moving the shared names down a layer):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_transport_imports_no_sidecar():
    """transport/ holds bytes and memory only; sidecar builds on it, never the other way."""
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _graph().items()
        if m.startswith("transport")
        for d in deps
        if d.startswith("sidecar")
    )
    assert not bad, bad


def test_adapters_import_no_daemon():
    """Engine adapters run inside engine processes: they may use the plan and protocol, never the daemon."""
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _graph().items()
        if m.startswith("adapters")
        for d in deps
        if d.startswith("sidecar.daemon")
    )
    assert not bad, bad


ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(source: str) -> list[int]:
    """Lines of ``source`` that name ``os.environ``, ``os.getenv`` and the like (or import them)."""
    tree = ast.parse(source)
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ENVIRONMENT_NAMES]
    lines += [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and n.module == "os"
        and ENVIRONMENT_NAMES & {a.name for a in n.names}
    ]
    return sorted(lines)


def test_transport_reads_the_environment_in_one_place():
    """The variables transport/ needs belong to CUDA, NIXL and UCX, which read them from the process
    environment themselves; transport/process_env.py is the one module that looks there (refitd's
    own settings reach transport/ as arguments)."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "transport").rglob("*.py"))
        if path.name != "process_env.py"
        for line in _environment_uses(path.read_text())
    ]
    assert not bad, f"read the environment through transport.process_env: {bad}"


def test_the_environment_check_sees_a_read():
    """The checker itself can fail: each way of reaching the environment is found."""
    source = "import os\nfrom os import getenv\nos.environ.get('X')\nos.getenv('Y')\nx = 1\n"
    assert _environment_uses(source) == [2, 3, 4]


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The checker itself can fail: a two-module ring is reported."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
