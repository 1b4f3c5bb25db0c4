"""The package's import graph has no cycles (imports inside functions included) and no private names cross modules.

A cycle means two modules cannot be understood, tested or changed apart; a lazy import inside a function hides a
cycle from Python but not from a reader, so those count too. A package __init__ that re-exports its submodules
and a submodule that imports back from the package form a cycle as well: submodules import their siblings.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "farmflow").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names imported from it) for every import in the file, at any depth."""
    out = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
            out.append((module, [n for n in names if f"{module}.{n}" not in known]))
            out += [(m, []) for m in submodules]
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return [(m, names) for m, names in out if m in known and m != name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    known = modules()
    assert "farmflow.config" in known and "farmflow.tasks.registry" in known
    graph = {name: {m for m, _ in imports(name, path, known)} for name, path in known.items()}
    assert cycles(graph) == []


def test_no_private_name_imported_from_another_module():
    known = modules()
    crossing = [
        f"{name} imports {n} from {m}"
        for name, path in known.items()
        for m, names in imports(name, path, known)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert crossing == []
