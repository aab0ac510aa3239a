"""The code's shape: no import cycle in service/, worker/ or trainer/, and no domain of the
server reaching into another's private names.

Both are AST walks over the source, so they hold for imports inside functions too (a lazy
import that closes a cycle is still a cycle a reader has to untangle). Imports under
``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "worker", "trainer")
SERVER = "service.api"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            stack.append(child)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (``from pkg import mod`` counts as pkg.mod)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, path, node)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                # the longest known module that the dotted name starts with
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    graph[name].add(".".join(parts))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def _domain(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(SERVER + ".") and len(parts) > 3 else None


def test_no_import_cycle() -> None:
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_domain_imports_another_domains_private_names() -> None:
    modules = _modules()
    offences = []
    for name, path in modules.items():
        mine = _domain(name)
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _resolve(name, path, node)
            theirs = _domain(source)
            if not source.startswith(SERVER + ".") or theirs is None or theirs == mine:
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    offences.append(f"{name} imports {source}.{alias.name}")
    assert not offences, "\n".join(offences)


def test_server_domains_are_packages() -> None:
    """Every module of the server lives in a domain package, except the composition root."""
    loose = sorted(
        path.name
        for path in (REPO / "service" / "api").glob("*.py")
        if path.name not in ("__init__.py", "app.py")
    )
    assert loose == [], f"modules outside a domain package: {loose}"
