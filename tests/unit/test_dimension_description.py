"""dim_layout_group described once (pin_pipelines/devstats/dimension.py), and what must follow it
by name: the DDL the migration runs, the reconciliation's read (`current_rows`) and source query
(`layout_group_sources`), its compared values (`Snapshot`), and the loader's row. Read from the
files, no service: a column added, renamed or moved in one place and not the others fails here."""

from __future__ import annotations

import dataclasses
import re
import uuid
from datetime import UTC, datetime

import msgspec

from pin_pipelines.clickhouse.sqlfiles import (
    CLICKHOUSE_SCHEMA,
    CLICKHOUSE_SQL_DIR,
    named_queries,
    statements,
)
from pin_pipelines.config import SQL_DIR
from pin_pipelines.devstats import LayoutGroup
from pin_pipelines.devstats.events import COLUMNS, LayoutGroupUpserted
from pin_pipelines.devstats.loading import DIM_LAYOUT_GROUP
from pin_pipelines.reconcile import Snapshot
from pin_pipelines.reconcile.dimension import _LayoutGroupSource

D = DIM_LAYOUT_GROUP


def _select_list(sql: str) -> list[str]:
    """The items between SELECT and FROM, split at the top level's commas."""
    body = re.search(r"SELECT\s+(.*?)\s+FROM\s", sql, re.S | re.I)
    assert body is not None, sql
    items, depth, current = [], 0, ""
    for char in body.group(1):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()]


def _output_name(item: str) -> str:
    alias = re.search(r"\bAS\s+(\w+)\s*$", item, re.I)
    return alias.group(1) if alias else item.split(".")[-1]


def test_the_ddl_creates_the_described_table() -> None:
    """Tried: the CREATE TABLE of the current ClickHouse definition (sql/clickhouse/schema.sql,
    which the migrations are held equal to) against the description: its name, each column and
    type in order, the engine's version column and the sorting key."""
    (create,) = [s for s in statements(CLICKHOUSE_SCHEMA) if s.upper().startswith("CREATE TABLE")]
    table = re.search(r"CREATE TABLE (?:IF NOT EXISTS )?(\S+)", create)
    assert table is not None and table.group(1) == D.table
    columns = re.search(r"\((.*)\)\s*ENGINE", create, re.S)
    assert columns is not None
    declared = [tuple(line.rstrip(",").split()) for line in columns.group(1).strip().splitlines()]
    assert declared == [(c.name, c.clickhouse_type) for c in D.columns]
    assert re.search(rf"ENGINE = ReplacingMergeTree\({D.upserted}\)", create)
    assert re.search(rf"ORDER BY \({D.key}\)", create)


def test_the_reconciliations_read_selects_each_compared_column_by_its_name() -> None:
    """Tried: `current_rows` (sql/clickhouse/queries/dim_layout_group.sql): the key as `id`, then
    each compared column's current value (argMax by UpsertedAt, then SourceVersion) under its
    compared name, in the table's order."""
    sql = named_queries(CLICKHOUSE_SQL_DIR / "queries" / "dim_layout_group.sql")["current_rows"]
    items = _select_list(sql)
    assert items[0] == f"{D.key} AS id"
    expected = [
        f"argMax({c.name}, ({D.upserted}, {D.version})) AS {c.compared_as}"
        for c in D.columns
        if c.compared_as is not None
    ]
    assert items[1:] == expected


def test_the_source_and_the_compared_values_carry_the_compared_names() -> None:
    """Tried: `Snapshot`'s fields, the source row's, and the output names of
    `layout_group_sources` (sql/postgres/queries/reconcile.sql), against the description."""
    assert tuple(f.name for f in dataclasses.fields(Snapshot)) == D.compared
    assert {f.name for f in dataclasses.fields(_LayoutGroupSource)} == {"id", *D.compared}
    text = (SQL_DIR / "postgres" / "queries" / "reconcile.sql").read_text()
    query = text.split("-- name: layout_group_sources()", 1)[1].split("-- name:", 1)[0]
    assert [_output_name(item) for item in _select_list(query)] == ["id", *D.compared]


def test_the_loaders_row_takes_each_column_from_its_described_field() -> None:
    """Tried: an event whose every field has a value of its own, through `row()`: each column
    holds the value of the field the description names (converted where it says), in COLUMNS
    order, which is the table's."""
    event = LayoutGroupUpserted(
        contract_version=1,
        id=uuid.uuid4(),
        version=7,
        project_id=uuid.uuid4(),
        tenant_id=uuid.uuid4(),
        name="Студии",
        sort_order=-3,
        is_archived=True,
        created_at=datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
    )
    fields = {f.name for f in msgspec.structs.fields(LayoutGroupUpserted)}
    assert {c.event_field for c in D.columns} <= fields
    assert D.names == COLUMNS
    assert event.row() == tuple(
        (c.to_clickhouse or (lambda v: v))(getattr(event, c.event_field)) for c in D.columns
    )
    assert dict(zip(COLUMNS, event.row(), strict=True))["IsArchived"] == 1


def test_the_reads_and_the_guard_name_what_their_callers_read() -> None:
    """Tried: the output names of the online reads (`groups`, `labels`) and of the loader's
    version guard (`stored_versions`) against what reads.py and dim.py read them by, and the
    online reads' scope against the described scope column."""
    reads = named_queries(CLICKHOUSE_SQL_DIR / "queries" / "dim_layout_group_reads.sql")
    operator_reads = named_queries(CLICKHOUSE_SQL_DIR / "queries" / "dim_layout_group.sql")
    names = {
        name: [_output_name(item) for item in _select_list(sql)]
        for name, sql in {
            "groups": reads["groups"],
            "labels": reads["labels"],
            "stored_versions": operator_reads["stored_versions"],
        }.items()
    }
    assert names == {
        "groups": [f.name for f in dataclasses.fields(LayoutGroup)],
        "labels": ["layout_group_id", "name"],
        "stored_versions": ["layout_group_id", "source_version"],
    }
    # The online reads answer an actor's developer only: each group's current scope column.
    scoped = f"argMax({D.scope}, ({D.upserted}, {D.version})) = %(developer_id)s"
    assert all(scoped in reads[name] for name in ("groups", "labels"))
