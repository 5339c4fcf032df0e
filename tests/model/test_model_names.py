"""model/recalc_queue.pml names only SQL that exists: every `chessboard.<name>` in it is an object
that sql/postgres/schema/ defines (what runs now, tests/integration/test_schema_current.py), and
every `queries/recalc.sql:<name>` a named query of sql/postgres/queries/recalc.sql. A model
that names a function since renamed or dropped (as it once named the drain's `_process_next`
after the drain had moved into chessboard.recalc_tick) fails here, so the model and the code
cannot drift apart silently.

Tried: the model as it is (every name defined), and a model text naming an undefined function
and an undefined query, which both are reported (test_an_unknown_name_is_reported)."""

from __future__ import annotations

import re
from pathlib import Path

from pin_pipelines.migrate import PG_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "model" / "recalc_queue.pml"
QUERIES = ROOT / "sql" / "postgres" / "queries" / "recalc.sql"

DEFINED = re.compile(
    r"CREATE\s+(?:OR\s+REPLACE\s+)?(?:TABLE|VIEW|FUNCTION|PROCEDURE|INDEX|TRIGGER|SEQUENCE)\s+"
    r"(?:IF\s+NOT\s+EXISTS\s+)?(?:chessboard\.)?(\w+)",
    re.IGNORECASE,
)


def schema_objects() -> set[str]:
    """The names sql/postgres/schema/ creates."""
    return {
        name.lower()
        for path in PG_SCHEMA.glob("*.sql")
        for name in DEFINED.findall(path.read_text(encoding="utf-8"))
    }


def named_queries() -> set[str]:
    return set(re.findall(r"^-- name: (\w+)", QUERIES.read_text(encoding="utf-8"), re.MULTILINE))


def unknown_names(model: str) -> list[str]:
    """What the model text names that the SQL does not define, each with its kind."""
    objects, queries = schema_objects(), named_queries()
    missing = [
        f"chessboard.{name}: not defined in sql/postgres/schema/"
        for name in sorted(set(re.findall(r"\bchessboard\.(\w+)", model)))
        if name.lower() not in objects
    ]
    missing += [
        f"queries/recalc.sql:{name}: no such named query"
        for name in sorted(set(re.findall(r"queries/recalc\.sql:(\w+)", model)))
        if name not in queries
    ]
    return missing


def test_the_model_names_only_defined_sql() -> None:
    """Every SQL object and named query the model cites exists; and it cites the tick's
    functions (a model that named none would pass vacuously)."""
    model = MODEL.read_text(encoding="utf-8")
    assert not unknown_names(model), "\n".join(unknown_names(model))
    for name in ("recalc_tick", "recalc_project_step", "recalc_claimed_project", "release_claim"):
        assert f"chessboard.{name}" in model, name
    assert "queries/recalc.sql:settle_abandoned_claims" in model


def test_an_unknown_name_is_reported() -> None:
    """A name the SQL does not define is reported, a defined one is not."""
    text = "chessboard.recalc_tick chessboard._process_next queries/recalc.sql:_give_back"
    assert unknown_names(text) == [
        "chessboard._process_next: not defined in sql/postgres/schema/",
        "queries/recalc.sql:_give_back: no such named query",
    ]
