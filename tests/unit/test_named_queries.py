"""Every named query the product calls exists, with exactly the parameters it is called with.
The modules reach their SQL as `Q = queries("<file>", <Face>)`: mypy checks every call against
the face (pin_pipelines/sql_faces.py), and here each face is held to its file (its methods are
exactly the file's named queries, each with exactly the file's `:params` as keyword parameters
after the connection), so a typo in a query's name, or a parameter renamed in the `.sql` file
and not in the caller, fails before that line runs. The callers are also read from their syntax
tree and checked against aiosql's parse of `sql/postgres/queries/<file>.sql` directly. Also: no
query of a product file is left without a caller (dead SQL).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pin_pipelines import sql_faces
from pin_pipelines.db import QUERIES_DIR, queries

PACKAGE = Path(__file__).resolve().parents[2] / "pin_pipelines"
#: Helpers of pin_pipelines/db.py that take a named query as their first argument; their own
#: positional arguments before the query's parameters.
FETCHERS = {"fetch_one": 3, "fetch_all": 3, "fetch_column": 2}


@dataclass(frozen=True)
class Use:
    """`Q.<name>` at `where`; `params` the keywords passed, None when a `**mapping` hides them."""

    file: str
    face: str
    name: str
    params: frozenset[str] | None
    where: str


def _query_file(tree: ast.Module) -> tuple[str, str] | None:
    """The file and the face's name of `Q = queries("<file>", <Face>)` in this module, if any."""
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "queries"
            and any(isinstance(t, ast.Name) and t.id == "Q" for t in targets)
        ):
            arg, face = value.args
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            assert isinstance(face, ast.Name), "a face of pin_pipelines/sql_faces.py, by name"
            return arg.value, face.id
    return None


def _keywords(call: ast.Call) -> frozenset[str] | None:
    if any(k.arg is None for k in call.keywords):
        return None
    return frozenset(k.arg for k in call.keywords if k.arg is not None)


def uses() -> Iterator[Use]:
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found = _query_file(tree)
        if found is None:
            continue
        file, face = found
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        fetches = {
            id(n.args[0]): n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in FETCHERS
            and n.args
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Q"
            ):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            call = calls.get(id(node)) or fetches.get(id(node))
            yield Use(file, face, node.attr, _keywords(call) if call else None, where)


ALL_USES = list(uses())


def named(file: str) -> Any:
    """The file's named queries as aiosql parsed them (its face only changes their static type)."""
    return queries(file, object)


def query_names(file: str) -> set[str]:
    """The named queries of the file (aiosql adds a `<name>_cursor` twin of each SELECT: not a
    query of the file)."""
    available = named(file).available_queries
    return {
        n
        for n in available
        if not (n.endswith("_cursor") and n.removesuffix("_cursor") in available)
    }


def test_the_callers_are_found() -> None:
    """The scan itself: every product SQL file has callers, and the drain's tick is among them."""
    files = {u.file for u in ALL_USES}
    product_files = {p.stem for p in QUERIES_DIR.glob("*.sql")}
    assert files == product_files, (files, product_files)
    tick = [u for u in ALL_USES if u.name == "recalc_tick"]
    assert tick and tick[0].params == frozenset(
        {"batch", "claim_for", "attempted", "traceparents", "lock_share"}
    ), tick


@pytest.mark.parametrize("use", ALL_USES, ids=lambda u: f"{u.file}.{u.name}@{u.where}")
def test_a_called_query_exists_with_the_parameters_passed(use: Use) -> None:
    file_queries = named(use.file)
    assert hasattr(file_queries, use.name), f"{use.where}: no query {use.name} in {use.file}.sql"
    if use.params is not None:
        declared = frozenset(getattr(file_queries, use.name).parameters or ())
        assert use.params == declared, (
            f"{use.where}: {use.file}.{use.name} is called with {sorted(use.params)},"
            f" declares {sorted(declared)}"
        )


def test_no_product_query_is_left_without_a_caller() -> None:
    used = {(u.file, u.name) for u in ALL_USES}
    for file in {u.file for u in ALL_USES}:
        unused = sorted(n for n in query_names(file) if (file, n) not in used)
        assert not unused, f"{file}.sql: queries nothing calls: {unused}"


def faces() -> dict[str, str]:
    """Each product SQL file → the one face its modules see it through."""
    found: dict[str, set[str]] = {}
    for use in ALL_USES:
        found.setdefault(use.file, set()).add(use.face)
    assert all(len(f) == 1 for f in found.values()), f"a file with several faces: {found}"
    return {file: face for file, (face,) in found.items()}


FACES = faces()


@pytest.mark.parametrize("file", sorted(FACES))
def test_a_face_lists_exactly_its_files_queries_and_their_parameters(file: str) -> None:
    """The face's methods against the file: the same names, and per query the connection
    then exactly the file's `:params`, keyword-only (as every caller passes them)."""
    face = getattr(sql_faces, FACES[file])
    methods = {n for n, v in vars(face).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == query_names(file), (
        f"{FACES[file]} lists {sorted(methods - query_names(file))} that {file}.sql lacks and"
        f" lacks {sorted(query_names(file) - methods)}"
    )
    for name in sorted(methods):
        params = list(inspect.signature(getattr(face, name)).parameters.values())
        assert [p.name for p in params[:2]] == ["self", "conn"], f"{FACES[file]}.{name}"
        keywords = params[2:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in keywords), (
            f"{FACES[file]}.{name}: parameters after conn are keyword-only"
        )
        declared = frozenset(getattr(named(file), name).parameters or ())
        assert {p.name for p in keywords} == declared, (
            f"{FACES[file]}.{name} takes {sorted(p.name for p in keywords)},"
            f" {file}.sql declares {sorted(declared)}"
        )


def test_every_face_is_used() -> None:
    """No face of pin_pipelines/sql_faces.py outlives its file's callers."""
    declared = {
        n for n, v in vars(sql_faces).items() if inspect.isclass(v) and n.endswith("Queries")
    }
    assert declared == set(FACES.values())
