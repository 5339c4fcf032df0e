"""The package's layering, read from the source (ast), nothing imported or started:
- no import cycle among pin_pipelines modules (module-level imports: what runs at import time);
- Dagster is imported only by the Dagster wiring and the few core modules that drive a Dagster
  instance themselves (DAGSTER_MODULES): the core stays callable from `pin` without it;
- no module imports a private name (`_x`) of another domain;
- the read API (`pin_pipelines.api`) cannot reach the operator side of the dimension: no import
  of it, direct or through other modules, at module level or inside a function, leads to the
  loader's version guard and write (`devstats.dim`), the operator's Actor (`devstats.operator`),
  the loader or its face (`devstats.loading`), the reconciliation or the CLI; of devstats it
  reaches the Actor and the scoped reads only;
- a package with a public face (FACES) is imported from outside only through it, never through a
  module behind it (FACE_EXCEPTIONS name the few that may, and why), and every name of a face's
  `__all__` is bound in it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pin_pipelines.config import SOURCE_ROOT

PACKAGE = "pin_pipelines"
PACKAGE_DIR = SOURCE_ROOT / PACKAGE

#: The modules that may import dagster (or dagster_*), besides everything under defs/: the code
#: location, `pin serve` (it opens the instance to wait for runs on a stop), and the retention of
#: finished runs, which works on a DagsterInstance for `pin dagster prune` and the daily job;
#: `pin db migrate`, which makes Dagster's storage tables as the schema's owner (dagster-postgres,
#: inside the function: the rest of the module runs without it).
#: dagster_instance.py writes the instance's YAML and needs no Dagster import.
DAGSTER_MODULES = frozenset(
    {
        "pin_pipelines.definitions",
        "pin_pipelines.migrate",
        "pin_pipelines.serve",
        "pin_pipelines.housekeeping.retention",
    }
)
DAGSTER_PACKAGES = ("pin_pipelines.defs",)


@dataclass(frozen=True)
class Import:
    """One imported module (resolved to a module of the package when it is one) and the names
    taken from it; `module_level` is False inside a function, a class or `if TYPE_CHECKING`."""

    importer: str
    module: str
    names: tuple[str, ...]
    module_level: bool
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


MODULES = package_modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], module_level: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """Every statement, with whether it runs when the module is imported."""
    for node in body:
        yield node, module_level
        if isinstance(node, ast.If):
            yield from _statements(node.body, module_level and not _is_type_checking(node))
            yield from _statements(node.orelse, module_level)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _statements(block, module_level)
            for handler in node.handlers:
                yield from _statements(handler.body, module_level)
        elif isinstance(node, ast.With):
            yield from _statements(node.body, module_level)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _statements(node.body, False)
        elif isinstance(node, ast.For | ast.While):
            yield from _statements(node.body, module_level)
            yield from _statements(node.orelse, module_level)


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(name: str) -> list[Import]:
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node, module_level in _statements(tree.body, True):
        if isinstance(node, ast.Import):
            found += [Import(name, a.name, (), module_level, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, path.name == "__init__.py", node)
            for alias in node.names:
                # `from pin_pipelines.x import y` where y is a module imports that module.
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append(Import(name, submodule, (), module_level, node.lineno))
                else:
                    found.append(Import(name, source, (alias.name,), module_level, node.lineno))
    return found


ALL_IMPORTS = [imp for name in MODULES for imp in imports_of(name)]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(*, function_level: bool = False) -> dict[str, set[str]]:
    """importer → the package modules its module-level imports run (with `function_level`, its
    imports inside functions too). Importing a.b.c also runs the packages a.b and a, except
    those the importer is inside (already being imported)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in ALL_IMPORTS:
        if not (imp.module_level or function_level) or imp.module not in MODULES:
            continue
        own = set(_ancestors(imp.importer))
        graph[imp.importer] |= {
            m for m in [*_ancestors(imp.module), imp.module] if m in MODULES and m not in own
        } - {imp.importer}
    return graph


def reachable(start: list[str]) -> set[str]:
    """Every package module that importing `start` may run, function-level imports included
    (a function that imports the operator's door reaches it when called), `start` excluded."""
    graph = import_graph(function_level=True)
    seen, todo = set(start), list(start)
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen - set(start)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def domain(module: str) -> tuple[str, ...]:
    """The room a module belongs to: `defs.<domain>` under defs/, else its first name under the
    package (a subpackage, or a top-level module on its own)."""
    parts = module.split(".")[1:]
    return tuple(parts[:2]) if parts[:1] == ["defs"] else tuple(parts[:1])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# --- the helpers themselves, on made-up graphs ------------------------------------------------


def test_cycles_finds_a_cycle_and_only_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_domains_are_packages_and_defs_folders() -> None:
    assert domain("pin_pipelines.recalc.drain") == ("recalc",)
    assert domain("pin_pipelines.defs.recalc.jobs") == ("defs", "recalc")
    assert domain("pin_pipelines.defs.common") == ("defs", "common")
    assert domain("pin_pipelines.config") == ("config",)


def test_the_walk_sees_every_module_and_resolves_relative_and_submodule_imports() -> None:
    """Tried: a name for each file, and the definitions' own imports (each domain's
    defs package, imported as a submodule by `from pin_pipelines.defs import devstats, …`)."""
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len({module_name(path) for path in paths}) == len(paths)
    assert {"pin_pipelines.defs.recalc", "pin_pipelines.defs.relay"} <= import_graph()[
        "pin_pipelines.definitions"
    ]


# --- the package ------------------------------------------------------------------------------


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_only_the_dagster_wiring_imports_dagster() -> None:
    """Every import of dagster or dagster_* (function-level ones too) outside defs/ and
    DAGSTER_MODULES; and each module of DAGSTER_MODULES still needs its place on the list."""
    importers = {
        imp.importer
        for imp in ALL_IMPORTS
        if imp.module.split(".")[0] == "dagster" or imp.module.startswith("dagster_")
    }
    outside = sorted(
        m
        for m in importers
        if m not in DAGSTER_MODULES
        and not any(m == p or m.startswith(f"{p}.") for p in DAGSTER_PACKAGES)
    )
    assert outside == []
    assert sorted(DAGSTER_MODULES - importers) == []


def test_no_module_imports_another_domains_private_names() -> None:
    violations = [
        f"{imp.importer}:{imp.line} imports {imp.module} {', '.join(imp.names)}".strip()
        for imp in ALL_IMPORTS
        if imp.module.startswith(f"{PACKAGE}.")
        and domain(imp.importer) != domain(imp.module)
        and (
            any(_private(part) for part in imp.module.split("."))
            or any(_private(name) for name in imp.names)
        )
    ]
    assert violations == []


#: The read API's package, and what it must never reach: the dimension's operator side (reads and
#: writes across every developer, the operator's Actor) and everything that uses it.
API_PACKAGE = f"{PACKAGE}.api"
OPERATOR_SIDE = (
    f"{PACKAGE}.devstats.dim",
    f"{PACKAGE}.devstats.operator",
    f"{PACKAGE}.devstats.loader",
    f"{PACKAGE}.devstats.loading",
    f"{PACKAGE}.reconcile",
    f"{PACKAGE}.cli",
    f"{PACKAGE}.defs",
    f"{PACKAGE}.definitions",
)
#: All the API may use of devstats: the Actor and the reads that take one.
API_DEVSTATS = {f"{PACKAGE}.devstats", f"{PACKAGE}.devstats.actor", f"{PACKAGE}.devstats.reads"}


def api_modules() -> list[str]:
    return [m for m in MODULES if m == API_PACKAGE or m.startswith(f"{API_PACKAGE}.")]


def test_reachable_follows_imports_inside_functions() -> None:
    """The walk the API's check relies on: the CLI imports the operator's door inside its
    handler only, and that counts."""
    assert f"{PACKAGE}.devstats.operator" in reachable([f"{PACKAGE}.cli"])
    assert f"{PACKAGE}.devstats.reads" in reachable(["pin_pipelines.devstats.dim"])


def test_the_api_cannot_reach_the_operator_side_of_the_dimension() -> None:
    """Tried: every module of pin_pipelines/api and all it may import, transitively. The
    operator reads (`stored_versions`, the reconciliation's `current_rows`), the loader's write
    and `operator_actor` are out of its reach; devstats gives it the Actor and the scoped reads."""
    found = reachable(api_modules())
    assert len(api_modules()) >= 5, api_modules()
    leaks = sorted(m for m in found if any(m == o or m.startswith(f"{o}.") for o in OPERATOR_SIDE))
    assert leaks == []
    devstats = {m for m in found if m.startswith(f"{PACKAGE}.devstats")}
    assert devstats <= API_DEVSTATS, sorted(devstats - API_DEVSTATS)


#: The packages with a public face → the modules that are it: `__init__`, and for devstats a
#: second face for its operator side (`devstats.loading`, which its `__init__` must not import:
#: the API would reach the loader through any `devstats` import). Outside its package, only these
#: are imported.
FACES = {
    f"{PACKAGE}.clickhouse": (f"{PACKAGE}.clickhouse",),
    f"{PACKAGE}.devstats": (f"{PACKAGE}.devstats", f"{PACKAGE}.devstats.loading"),
    f"{PACKAGE}.recalc": (f"{PACKAGE}.recalc",),
    f"{PACKAGE}.reconcile": (f"{PACKAGE}.reconcile",),
    f"{PACKAGE}.relay": (f"{PACKAGE}.relay",),
}
#: (importer, module behind a face) pairs allowed anyway. The dev stack waits on the ClickHouse
#: server it started, by its address rather than a URL, so it needs the server backend itself; the
#: face only imports the backends lazily (`open_clickhouse`), so that a process never loads the
#: engine or the driver it does not use.
FACE_EXCEPTIONS = frozenset(
    {
        (f"{PACKAGE}.stack.clickhouse_server", f"{PACKAGE}.clickhouse.server"),
        (f"{PACKAGE}.stack.clickhouse_cluster", f"{PACKAGE}.clickhouse.server"),
    }
)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def face_bypasses() -> list[tuple[str, str, int]]:
    """(importer, module, line) of every import, function-level and `TYPE_CHECKING` ones too, of
    a module behind a face from outside its package."""
    return sorted(
        {
            (imp.importer, imp.module, imp.line)
            for imp in ALL_IMPORTS
            for package, faces in FACES.items()
            if imp.module.startswith(f"{package}.")
            and imp.module not in faces
            and not _inside(imp.importer, package)
        }
    )


def test_other_packages_import_a_faced_package_through_its_face_only() -> None:
    """Tried on the code before the packages had faces: 38 imports, among them defs/recalc's and
    defs/devstats' (`recalc.drain`, `devstats.loader`, `devstats.freshness`, …), the CLI's
    function-level ones, reconcile's `devstats.dim` QUERIES and `recalc.enqueue`, the API's
    `devstats.actor` and `devstats.reads`, metrics' `recalc.counters`, `relay.metrics` and
    `devstats.offsets`, and the stack's and devstats' `clickhouse.url`, `clickhouse.literals` and
    `clickhouse.sqlfiles`. Each exception must still be needed."""
    found = face_bypasses()
    violations = [
        f"{i}:{line} imports {m}" for i, m, line in found if (i, m) not in FACE_EXCEPTIONS
    ]
    assert violations == []
    assert sorted(FACE_EXCEPTIONS - {(i, m) for i, m, _ in found}) == []


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [str(name) for name in ast.literal_eval(node.value)]
    return None


def _bound_at_import(tree: ast.Module) -> set[str]:
    """The names a module binds when imported (`if TYPE_CHECKING` imports are not)."""
    bound: set[str] = set()
    for node, module_level in _statements(tree.body, True):
        if not module_level:
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    return bound


def _taken_from(package: str, name: str, tree: ast.Module) -> set[str]:
    """The names a face's module-level imports take from the modules of its own package."""
    return {
        alias.asname or alias.name
        for node, module_level in _statements(tree.body, True)
        if module_level
        and isinstance(node, ast.ImportFrom)
        and _inside(_absolute(name, MODULES[name].name == "__init__.py", node), package)
        for alias in node.names
    }


def test_every_face_declares_all_and_binds_each_name_of_it() -> None:
    """Tried on the code before the packages had faces: recalc's and devstats' `__init__` had no
    `__all__` and `devstats.loading` did not exist. Also fails on a name listed twice or not bound
    (a typo, a name moved away), and on a name a face takes from its own package but leaves out of
    `__all__` (public by accident, as `from pin_pipelines.x import *` would not give it)."""
    for package, faces in FACES.items():
        for face in faces:
            assert face in MODULES, face
            tree = ast.parse(MODULES[face].read_text(), str(MODULES[face]))
            exported = _all_of(tree)
            assert exported is not None, f"{face} has no __all__"
            assert len(set(exported)) == len(exported), face
            assert sorted(set(exported) - _bound_at_import(tree)) == [], face
            assert sorted(_taken_from(package, face, tree) - set(exported)) == [], face
