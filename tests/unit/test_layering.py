"""The import layering of scaletrain, read from the source with `ast` (nothing is imported): no cycles, a leaf
config module, and functions short enough to read (STYLE.md habits 5 and 10)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "scaletrain"
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The scaletrain modules `module` imports anywhere in its file: at the top, inside functions, under
    TYPE_CHECKING. `from a.b import c` counts as importing a.b.c when that is a module, else a.b. (The parent
    packages Python runs on the way, a and a.b's __init__, are not counted: a package's __init__ re-exporting its
    submodules would otherwise make a cycle of every submodule that imports a sibling.)"""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.split(".")[0] == "scaletrain"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1 more
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "scaletrain":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else known(base))
    return found - {None, module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring the modules on the path)."""
    on_path: list[str] = []
    state: dict[str, str] = {}  # "open" while on the path, "done" once every import below it is searched

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return on_path[on_path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        on_path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_import_graph_is_acyclic():
    graph = import_graph()
    assert "scaletrain.cli" in graph and "scaletrain.launch" in graph["scaletrain.cli"]  # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_config_is_a_leaf():
    allowed = {"scaletrain.errors"}
    imported = import_graph()["scaletrain.config"]
    assert imported <= allowed, f"scaletrain.config imports {sorted(imported - allowed)}"


def test_nothing_but_the_entry_point_imports_the_cli():
    # cli -> launch -> train -> packages, one way: the worker entry lives in launch, not in the CLI.
    importers = {name for name, imported in import_graph().items() if "scaletrain.cli" in imported}
    assert importers == {"scaletrain.__main__"}


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
