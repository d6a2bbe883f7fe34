"""No two of kvshare's product modules import each other, directly or around a loop.

A circle of imports means neither module can be read, tested or moved without the
other, and it hides which one is the lower layer. The check parses the source with
`ast` (nothing is imported) and counts every import: at module level, inside functions,
and under `if TYPE_CHECKING:` too. A type-only import still ties the two modules'
meanings together (renaming a class breaks the other file), and a Protocol declared by
the lower module, or a value moved into a module of its own, always removes it.

An import of `package.name` is an edge to the module `package/name.py` when there is
one, else to the package (`package/__init__.py`). The parent packages Python imports
on the way are not counted: a package's `__init__` is a module like any other here.

`KNOWN` lists the circles that exist today and are still to be removed: the check
fails on any other, and on a known one that grew.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("kvshare", "kvcommon", "cacheserver", "replica_agent", "policy")
KNOWN: tuple[frozenset[str], ...] = ()


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The product modules `module` (at `path`) imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # `from a.b import c`: the module a.b.c if there is one, else a.b.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: set(_imported(module, path, known)) for module, path in known.items()}


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(start: str) -> None:
        # Iterative: a deep chain of imports must not hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            pushed = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    pushed = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if pushed:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return out


def test_the_check_finds_a_circle() -> None:
    """Positive control: a loop of three modules, and a pair, are found; a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(map(sorted, _circles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_type_checking_and_relative_imports() -> None:
    """What the walk counts, on modules that exist: a TYPE_CHECKING import of the put
    journal's client, a `from package import module` edge to that module."""
    graph = _graph()
    assert "cacheserver.store.journaled" in graph["cacheserver.store.writer"]
    assert "cacheserver.tiers.cluster.layout" in graph["cacheserver.tiers.cluster.accounting"]
    assert "cacheserver.tiers" in graph["cacheserver.tiers.memory"]


def test_no_product_module_imports_itself_around_a_loop() -> None:
    new = [
        sorted(circle)
        for circle in _circles(_graph())
        if not any(circle <= known for known in KNOWN)
    ]
    assert not new, (
        f"import circles among product modules: {new}; make the dependency run one way "
        "(move the shared piece into a module of its own, or declare a Protocol in the "
        "lower module)"
    )
