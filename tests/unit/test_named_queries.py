"""Every named query the product calls exists, with exactly the parameters it is called with.
The modules reach their SQL as `Q: Any = queries("<file>")`, so a typo in a query's
name, or a parameter renamed in the `.sql` file and not in the caller, would only fail when that
line runs; here both sides are read statically: the callers from their syntax tree, the queries
from aiosql's parse of `sql/postgres/queries/<file>.sql`. Also: no query of a product file is
left without a caller (dead SQL).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pin_pipelines.db import QUERIES_DIR, queries

PACKAGE = Path(__file__).resolve().parents[2] / "pin_pipelines"
#: Helpers of pin_pipelines/db.py that take a named query as their first argument; their own
#: positional arguments before the query's parameters.
FETCHERS = {"fetch_one": 3, "fetch_all": 3, "fetch_column": 2}


@dataclass(frozen=True)
class Use:
    """`Q.<name>` at `where`; `params` the keywords passed, None when a `**mapping` hides them."""

    file: str
    name: str
    params: frozenset[str] | None
    where: str


def _query_file(tree: ast.Module) -> str | None:
    """The file of `Q = queries("<file>")` (annotated or not) in this module, if any."""
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "queries"
            and any(isinstance(t, ast.Name) and t.id == "Q" for t in targets)
        ):
            arg = value.args[0]
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            return arg.value
    return None


def _keywords(call: ast.Call) -> frozenset[str] | None:
    if any(k.arg is None for k in call.keywords):
        return None
    return frozenset(k.arg for k in call.keywords if k.arg is not None)


def uses() -> Iterator[Use]:
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        file = _query_file(tree)
        if file is None:
            continue
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
            yield Use(file, node.attr, _keywords(call) if call else None, where)


ALL_USES = list(uses())


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
    named = queries(use.file)
    assert hasattr(named, use.name), f"{use.where}: no query {use.name} in {use.file}.sql"
    if use.params is not None:
        declared = frozenset(getattr(named, use.name).parameters or ())
        assert use.params == declared, (
            f"{use.where}: {use.file}.{use.name} is called with {sorted(use.params)},"
            f" declares {sorted(declared)}"
        )


def test_no_product_query_is_left_without_a_caller() -> None:
    used = {(u.file, u.name) for u in ALL_USES}
    for file in {u.file for u in ALL_USES}:
        named = queries(file)
        # aiosql adds a `<name>_cursor` twin of each SELECT: not a query of the file
        names = [
            n
            for n in named.available_queries
            if not (n.endswith("_cursor") and n.removesuffix("_cursor") in named.available_queries)
        ]
        unused = sorted(n for n in names if (file, n) not in used)
        assert not unused, f"{file}.sql: queries nothing calls: {unused}"
