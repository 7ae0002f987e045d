"""The package's shape: no import circles between specfork's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import specfork

ROOT = Path(specfork.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """specfork modules `path` imports (anywhere in it, except under `if TYPE_CHECKING:`)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module and node.module.startswith("specfork"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names if a.name.startswith("specfork"))

    Visitor().visit(ast.parse(path.read_text()))
    return found & modules


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {m: _imports(p, modules) - {m} for m, p in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, if there is any (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circles() -> None:
    graph = _graph()
    assert "specfork.engine.round" in graph and "specfork.cli.common" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_circle_finder_finds_circles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


#: specfork's packages and top-level modules, bottom to top (docs/architecture.md, "Modules"):
#: a module imports only from its own package and from those before it. The package's own
#: `__init__` (the public API, which re-exports from the top) stands above them all.
LAYERS = (
    "errors",
    "checks",
    "extras",
    "host",
    "steps",
    "atomic",
    "threads",
    "constraint",
    "catalog",
    "config",
    "spec_schema",
    "tree",
    "sampling",
    "penalties",
    "kv_cache",
    "verify",
    "kernels",
    "models",
    "loading",
    "heads",
    "drafters",
    "strategies",
    "engine",
    "tools",
    "server",
    "bench",
    "cli",
)


def _layer(module: str) -> str:
    """The top-level package or module of `specfork.x.y` ("x"; "" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = []
    for module, imports in sorted(graph.items()):
        here = _layer(module)
        if here == "":
            continue
        for imported in sorted(imports):
            there = _layer(imported)
            if there == "":  # `from specfork import __version__`: the one fact it holds
                continue
            if there != here and rank.get(there, len(LAYERS)) > rank.get(here, -1):
                found.append(f"{module} imports {imported}")
    return found


def test_imports_run_down_the_layers() -> None:
    graph = _graph()
    assert {_layer(m) for m in graph} - {""} == set(LAYERS)  # every package has its place
    assert _upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "specfork.models.cost_cache": {"specfork.bench.machine"},
        "specfork.bench.machine": {"specfork.host"},
    }
    assert _upward_imports(graph) == ["specfork.models.cost_cache imports specfork.bench.machine"]


def test_both_backends_declare_the_target_model_interface() -> None:
    """`models.target.TargetModel` is what the rest of specfork uses of a model: the eager and
    the kernels' model both have every member of it (methods, properties, attributes)."""
    from specfork.models.base import DecoderLM
    from specfork.models.fast import FastLM
    from specfork.models.target import TargetModel

    members = {n for n in vars(TargetModel) if not n.startswith("_") or n == "__call__"}
    members |= set(TargetModel.__annotations__)
    assert {"forward_capturing", "batch_invariant", "config", "thread_use"} <= members
    for cls in (DecoderLM, FastLM):
        annotated = set().union(*(getattr(c, "__annotations__", {}) for c in cls.__mro__))
        missing = sorted(m for m in members if not hasattr(cls, m) and m not in annotated)
        assert missing == [], f"{cls.__name__} lacks {missing}"
