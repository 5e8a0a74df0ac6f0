"""The import graph of kvpop/ and pipelines/, read from the source (every import, function-local ones included):
no cycles, the method package free of the pipelines and of Ray and MLflow, no stage reaching into another's private
names, and function-local imports in pipelines/ only for the optional heavy dependencies."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvpop", "pipelines")
# optional heavy dependencies, imported where used (datasets: only a stage that reads a text source needs it)
LOCAL_IMPORTS_ALLOWED = ("ray", "mlflow", "matplotlib", "datasets")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


class _Imports(ast.NodeVisitor):
    """Every import of one module: ``(imported module, names taken from it, line, function-local?)``."""

    def __init__(self, module: str, is_package: bool):
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, tuple[str, ...], int, bool]] = []
        self.depth = 0

    def _nested(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, (), node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = self.module.split(".")
            package = package if self.is_package else package[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        self.found.append((base, tuple(a.name for a in node.names), node.lineno, self.depth > 0))


def _imports(module: str) -> list[tuple[str, tuple[str, ...], int, bool]]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


def _edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (``from a import b`` counts ``a.b`` when that is a module)."""
    graph = {}
    for module in MODULES:
        targets = set()
        for imported, names, _, _ in _imports(module):
            if imported in MODULES:
                targets.add(imported)
            targets.update(f"{imported}.{n}" for n in names if f"{imported}.{n}" in MODULES)
        graph[module] = targets - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_reader_sees_every_import():
    graph = _edges()
    assert "pipelines.config" in graph["pipelines.store"] and "kvpop.retrofit" in graph["kvpop.objective"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    local = {(m, n) for m, n, _, is_local in _imports("pipelines.train") if is_local}
    assert ("mlflow", ()) in local  # a function-local import is found


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the first module of a strongly connected component (breadth-first)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return component


def test_no_import_cycles():
    graph = _edges()
    cycles = [_a_cycle(graph, c) for c in _cycles(graph)]
    assert not cycles, "import cycles, e.g. " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "kvpop"))
def test_the_method_package_stays_free_of_pipelines_ray_and_mlflow(module):
    bad = [(imported, line) for imported, _, line, _ in _imports(module)
           if imported.split(".")[0] in ("pipelines", "jobs", "ray", "mlflow")]
    assert not bad, f"{module} imports {bad}"


def _stage_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to pipelines modules (``from pipelines import train`` -> ``{"train": "pipelines.train"}``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "pipelines":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"pipelines.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pipelines.") and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("pipelines.")))
def test_no_private_names_from_another_pipelines_module(module):
    bad = [(imported, name, line) for imported, names, line, _ in _imports(module)
           if imported.startswith("pipelines.") and imported != module
           for name in names if name.startswith("_")]
    tree = ast.parse(MODULES[module].read_text())
    aliases = _stage_aliases(tree)
    bad += [(aliases[node.value.id], node.attr, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not bad, f"{module} uses private names of other modules: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("pipelines.")))
def test_function_local_imports_only_for_optional_heavy_dependencies(module):
    bad = [(imported, line) for imported, _, line, is_local in _imports(module)
           if is_local and imported.split(".")[0] not in LOCAL_IMPORTS_ALLOWED]
    assert not bad, f"{module} imports inside functions: {bad} (import at the top; only {LOCAL_IMPORTS_ALLOWED} wait)"


def _package_imports_at_import(package: str) -> set[str]:
    """The project modules a package's ``__init__`` imports when it runs: its top-level imports, not those under
    ``if TYPE_CHECKING:`` (what its lazy ``__getattr__`` imports on first use is not read here)."""
    tree = ast.parse(MODULES[package].read_text())
    found = set()
    for node in tree.body:  # top level only: an ``if`` block (TYPE_CHECKING) is left out
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
            found.update({node.module} & set(MODULES))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    return found - {package}


def test_the_config_does_not_import_the_retrofit():
    """Every CLI process imports pipelines.config: reading and checking a config must not import kvpop.retrofit and
    its transformers model machinery (~2 s of a core per process; kvpop.names holds what the checks need). A module
    of kvpop runs the package's ``__init__`` first: its eager imports count."""
    graph = _edges()
    seen, todo = set(), ["pipelines.config"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(graph[module] - {"kvpop"})
        if module.startswith("kvpop."):
            todo.extend(_package_imports_at_import("kvpop"))
    assert "kvpop.names" in seen and "kvpop.dms_cache" in seen  # the reader follows the package's eager imports
    assert "kvpop.retrofit" not in seen, sorted(seen)


def test_datasets_is_imported_only_where_a_text_source_is_read():
    """Every Ray worker (train workers, teacher actors, trials) and CLI process imports pipelines.data, but only
    reading a text source needs ``datasets`` (with pandas, ~0.25-0.7 s of a core per process): the functions that
    read one import it."""
    eager = [(module, line) for module in MODULES for imported, _, line, is_local in _imports(module)
             if imported.split(".")[0] == "datasets" and not is_local]
    assert not eager, f"module-level imports of datasets: {eager}"
    assert any(imported == "datasets" and is_local for imported, _, _, is_local in _imports("pipelines.data"))
