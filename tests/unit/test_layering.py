"""The import layering of scaletrain, read from the source with `ast` (nothing is imported): one ordered list of
layers and a few "never" rules (LAYERS, NEVER below), no cycles, a leaf config module, a bound on the longest import
chain, and functions short enough to read (STYLE.md habits 5 and 10). The diagram in docs/architecture.md is
rendered from the same list, so the two cannot drift; after changing LAYERS or NEVER, rewrite it with

    python -m tests.unit.test_layering --write
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scaletrain"
DOCS = ROOT / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 80
MAX_CHAIN = 11  # issue 22: the longest chain of module-level imports, in modules

# ------------------------------------------------------------------------------------------------ the layer list

# Bottom first. A module may import modules of its own layer and of the layers below, never above. A unit is a
# module or package named relative to scaletrain ("__init__" is the package itself), or a tuple of them that count as
# one; a module belongs to the unit with its longest prefix. In an "isolated" layer the units import none of each
# other.
LAYERS: list[tuple[str, str, tuple[str | tuple[str, ...], ...], bool]] = [
    (
        "ground",
        "errors and exit codes, device facts, the typed config tree",
        ("__init__", "errors", "hardware", "config"),
        False,
    ),
    (
        "parse",
        "TOML and dotted overrides to a typed Config, paths made absolute: reads and parses only",
        ("config.io",),
        False,
    ),
    ("run", "the run directory, continuing a run, a run started as a subprocess", ("run",), False),
    ("models", "plain PyTorch: no parallelism, no distributed calls", ("models",), False),
    (
        "components",
        "each mechanism with the object that owns its data",
        ("data", "optim", "precision", "parallel", "checkpoint", "metrics", "resilience"),
        False,
    ),
    ("estimators", "the planner's model: memory, time, search", ("planning.estimators",), False),
    ("job", "every problem of the config at once, before anything starts", ("validate",), False),
    ("training", "the job put together, then the loop, reading top to bottom", (("train", "job"),), False),
    (
        "commands",
        "one per CLI command; they share only what lies below",
        (
            "launch",
            "compare.bench",
            "compare.parity",
            "checkpoint.convert",
            "report",
            "inference",
            "planning",
            "compare",
        ),
        True,
    ),
    ("entry", "argument parsing and dispatch", ("cli", "__main__"), False),
]

# (importers, imported, why): no module of the first units imports one of the second, whatever the layers allow.
# "*" as imported: no scaletrain module at all.
NEVER: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("errors", "hardware"), ("*",), "the ground floor's leaves"),
    (("config",), ("__init__", "hardware", "run"), "config is a leaf: errors only"),
    (
        ("config.io",),
        ("models", "data", "optim", "precision", "parallel", "checkpoint", "metrics", "resilience"),
        "parsing knows no component",
    ),
    (
        ("parallel",),
        ("checkpoint", "metrics", "optim", "resilience"),
        "parallelism is applied to a model, nothing else",
    ),
    (("train", "job", "planning.estimators"), ("validate",), "the job is resolved below them, issue 22"),
]

# Imports that break a rule today, each with the reason and what removes it. The test fails on a violation not
# listed here, and on an entry that no longer happens (remove it then).
KNOWN: dict[tuple[str, str], str] = {}


def _units() -> dict[str, tuple[int, str]]:
    """Each unit prefix -> (its layer's index, the unit's label)."""
    out = {}
    for i, (_, _, units, _) in enumerate(LAYERS):
        for unit in units:
            parts = (unit,) if isinstance(unit, str) else unit
            for prefix in parts:
                out[prefix] = (i, parts[0])
    return out


def _rel(module: str) -> str:
    return module.removeprefix("scaletrain.") if module != "scaletrain" else "__init__"


def _matches(module: str, prefix: str) -> bool:
    rel = _rel(module)
    return rel == prefix or rel.startswith(prefix + ".")


def unit_of(module: str) -> tuple[int, str] | None:
    """(layer index, unit label) of a dotted module name, by its longest unit prefix; None when no layer holds it."""
    units = _units()
    best = max((p for p in units if _matches(module, p)), key=len, default=None)
    return None if best is None else units[best]


# ------------------------------------------------------------------------------------------------ the graph


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _import_nodes(tree: ast.Module, top_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, or with `top_level` only those that run when the module is imported: the module's
    own body, its `if`/`try` blocks included, but not function bodies and not `if TYPE_CHECKING:`."""
    if not top_level:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)

    visit(tree.body)
    return found


def _imported(module: str, path: Path, modules: dict[str, Path], top_level: bool = False) -> set[str]:
    """The scaletrain modules `module` imports: anywhere in its file (at the top, inside functions, under
    TYPE_CHECKING), or with `top_level` only at import time. `from a.b import c` counts as importing a.b.c when that
    is a module, else a.b. (The parent packages Python runs on the way, a and a.b's __init__, are not counted: a
    package's __init__ re-exporting its submodules would otherwise make a cycle of every submodule that imports a
    sibling.)"""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), top_level):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.split(".")[0] == "scaletrain"}
        else:
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


@functools.cache
def _graph(top_level: bool) -> dict[str, frozenset[str]]:
    modules = _modules()
    return {name: frozenset(_imported(name, path, modules, top_level)) for name, path in modules.items()}


def import_graph(top_level: bool = False) -> dict[str, set[str]]:
    """Module -> the scaletrain modules it imports (all imports; with `top_level`, those run at import time)."""
    return {m: set(deps) for m, deps in _graph(top_level).items()}


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


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports in an acyclic graph, as the modules along it (ties: the first by name)."""

    @functools.cache
    def below(node: str) -> tuple[str, ...]:
        paths = [below(n) for n in sorted(graph.get(node, ()))]
        return (node, *max(paths, key=len, default=()))

    return list(max((below(n) for n in sorted(graph)), key=len, default=()))


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between scaletrain's top-level folders and files (parallel, planner, validate, ...)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        a = _rel(module).split(".")[0]
        out.setdefault(a, set()).update(d for d in (_rel(x).split(".")[0] for x in deps) if d != a)
    return out


def violations(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks, with module names relative to scaletrain."""
    out = {}
    for module, deps in graph.items():
        here = unit_of(module)
        for dep in deps:
            there, pair = unit_of(dep), (_rel(module), _rel(dep))
            if here is None or there is None:
                continue  # test_every_module_has_a_layer names these
            if there[0] > here[0]:
                out[pair] = f"imports upward: layer {LAYERS[here[0]][0]} -> {LAYERS[there[0]][0]}"
            elif there[0] == here[0] and LAYERS[here[0]][3] and there[1] != here[1]:
                out[pair] = f"the {LAYERS[here[0]][0]} import none of each other"
            for importers, imported, why in NEVER:
                if any(_matches(module, p) for p in importers) and (
                    imported == ("*",) or any(_matches(dep, p) for p in imported)
                ):
                    out[pair] = f"never: {why}"
    return out


# ------------------------------------------------------------------------------------------------ the diagram

BEGIN, END = (
    "<!-- layers: generated by `python -m tests.unit.test_layering --write` -->",
    "<!-- layers: end -->",
)
WIDTH = 110


def render() -> str:
    """The layer list and the never rules as the text block docs/architecture.md shows (top layer first)."""
    lines = ["```"]
    for i, (name, role, units, isolated) in reversed(list(enumerate(LAYERS))):
        labels = [u if isinstance(u, str) else "|".join(u) for u in units]
        head = f"{name:<11} "
        row = head
        for label in labels:
            if len(row) + len(label) + 2 > WIDTH and row.strip() != name:
                lines.append(row.rstrip())
                row = " " * len(head)
            row += label + "  "
        lines.append(row.rstrip())
        lines.append(
            " " * len(head) + f"└ {role}" + (" (they import none of each other)" if isolated else "")
        )
        if i:
            lines.append(f"{'':<5}↓")
    lines += ["", "never (whatever the layers allow):"]
    for importers, imported, why in NEVER:
        target = "any scaletrain module" if imported == ("*",) else ", ".join(imported)
        row = f"  {', '.join(importers)} ↛ {target}: {why}"
        while len(row) > WIDTH:  # wrap at a space, continuation indented
            cut = row.rindex(" ", 0, WIDTH)
            lines.append(row[:cut])
            row = "      " + row[cut + 1 :]
        lines.append(row)
    lines += ["```"]
    return "\n".join(lines)


def docs_block() -> str | None:
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_docs() -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{render()}\n{END}{rest.split(END, 1)[1]}")


# ------------------------------------------------------------------------------------------------ tests


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_longest_chain_and_rules_on_a_small_graph():
    assert longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == ["a", "b", "c"]
    graph = {
        "scaletrain.config": {"scaletrain.models"},
        "scaletrain.compare.bench": {"scaletrain.compare.parity"},
    }
    assert violations(graph) == {
        ("config", "models"): "imports upward: layer ground -> models",
        ("compare.bench", "compare.parity"): "the commands import none of each other",
    }
    assert violations({"scaletrain.hardware": {"scaletrain.errors"}}) == {
        ("hardware", "errors"): "never: the ground floor's leaves"
    }


def test_the_import_graph_is_acyclic():
    graph = import_graph()
    assert "scaletrain.cli" in graph and "scaletrain.launch" in graph["scaletrain.cli"]  # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_has_a_layer_and_every_unit_exists():
    modules = _modules()
    homeless = sorted(_rel(m) for m in modules if unit_of(m) is None)
    assert not homeless, f"modules in no layer of LAYERS (tests/unit/test_layering.py): {homeless}"
    missing = sorted(p for p in _units() if not any(_matches(m, p) for m in modules))
    assert not missing, f"LAYERS names units that do not exist: {missing}; update it and run --write"


def test_imports_follow_the_layers_and_the_never_rules():
    found = violations(import_graph())
    new = {pair: why for pair, why in found.items() if pair not in KNOWN}
    assert not new, "layering broken:\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items())
    )
    gone = sorted(set(KNOWN) - set(found))
    assert not gone, f"KNOWN exceptions that no longer happen (remove them): {gone}"


def test_config_is_a_leaf():
    graph = import_graph()
    for module, allowed in (
        ("scaletrain.config", {"scaletrain.errors"}),
        ("scaletrain.config.io", {"scaletrain.config", "scaletrain.errors"}),
    ):
        imported = graph[module]
        assert imported <= allowed, f"{module} imports {sorted(imported - allowed)}"


def test_nothing_but_the_entry_point_imports_the_cli():
    # cli -> launch -> train -> packages, one way: the worker entry lives in launch, not in the CLI.
    importers = {name for name, imported in import_graph().items() if "scaletrain.cli" in imported}
    assert importers == {"scaletrain.__main__"}


def test_the_architecture_diagram_is_the_layer_list():
    assert docs_block() == render(), (
        "docs/architecture.md's layer diagram differs from LAYERS/NEVER in tests/unit/test_layering.py; "
        "regenerate it: python -m tests.unit.test_layering --write"
    )


def _chain_and_cycle() -> tuple[list[str], list[str] | None]:
    top = import_graph(top_level=True)
    chain = find_cycle(top) or longest_chain(
        top
    )  # a module cycle has no longest chain: the acyclic test names it
    return [_rel(m) for m in chain], find_cycle(folder_graph(import_graph()))


def test_the_longest_import_chain_is_short_and_folders_have_no_cycle():
    """The chain counts module-level imports (what runs when a module is imported); the folder cycle counts every
    import, function-local ones too, between scaletrain's top-level folders and files."""
    chain, folder_cycle = _chain_and_cycle()
    assert len(chain) > 5  # the graph is read
    assert len(chain) <= MAX_CHAIN, f"longest import chain {len(chain)}: {' -> '.join(chain)}"
    assert folder_cycle is None, "folder cycle: " + " -> ".join(folder_cycle)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_docs()
        print(f"wrote the layer diagram to {DOCS.relative_to(ROOT)}")
    else:
        chain, folder_cycle = _chain_and_cycle()
        print(render())
        print(f"\nlongest module-level chain ({len(chain)}): {' -> '.join(chain)}")
        print(f"folder cycle: {' -> '.join(folder_cycle or []) or 'none'}")
