"""dim_layout_group described once (spec 003): each column with its ClickHouse type, the event
field it comes from, and the source column the reconciliation computes it from; the key, the
version guard's column, the version that ReplacingMergeTree keeps (UpsertedAt) and the scope.

What follows from it, by name, never by a column's position:
- the loader's row (`LayoutGroupUpserted.row`, events.py) and the insert's column list;
- the reconciliation's comparison (reconcile/dimension.py): a source row and a dimension row are
  `Snapshot`s, built from `layout_group_sources` and from `current_rows` by the names below;
- the table's current definition (sql/clickhouse/schema.sql, which the migrations are held
  equal to), the operator read `current_rows` and the online reads (scoped by `scope`) are SQL
  files, kept equal to this description by tests/unit/test_dimension_description.py (SQL stays
  first-class: the DDL is what the migrations run, a read is a named query).
Adding a field to the snapshot: one Column here, the event's field (events.py), one ClickHouse
migration and one PostgreSQL migration (docs/layout.md says which files).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column of the dimension."""

    #: The ClickHouse column.
    name: str
    #: Its type on current ClickHouse (clickhouse/legacy.py downgrades it for 18.16).
    clickhouse_type: str
    #: The attribute of the decoded event (events.LayoutGroupUpserted) that fills it.
    event_field: str
    #: The name the reconciliation compares it under: the alias of `layout_group_sources`
    #: (PostgreSQL) and of `current_rows` (ClickHouse); None: not compared (the key, and the
    #: load time, which only orders versions).
    compared_as: str | None
    #: How the event's value is written (a flag is a UInt8); None: as it is.
    to_clickhouse: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Dimension:
    """A ClickHouse ReplacingMergeTree dimension loaded from one Kafka topic."""

    table: str
    columns: tuple[Column, ...]
    #: The sorting key: one row per key after merges.
    key: str
    #: The version guard's column: an event is applied only above the stored one.
    version: str
    #: ReplacingMergeTree's version: the newest row of a key wins at merge.
    upserted: str
    #: The column an actor's reads are scoped by (its developer).
    scope: str

    def __post_init__(self) -> None:
        assert len(set(self.names)) == len(self.columns), "a column named twice"
        for role in (self.key, self.version, self.upserted, self.scope):
            assert role in self.names, f"{role} is not a column of {self.table}"

    @property
    def names(self) -> tuple[str, ...]:
        """The columns, in the table's order: the insert's column list."""
        return tuple(column.name for column in self.columns)

    @property
    def compared(self) -> tuple[str, ...]:
        """What the reconciliation compares, in the table's order."""
        return tuple(c.compared_as for c in self.columns if c.compared_as is not None)

    def row_of(self) -> Callable[[Any], tuple[Any, ...]]:
        """The function from a decoded event to its row, in `names`' order, each value read from
        the event by its field's name. One C-level attrgetter for every field, then the few
        conversions: the loader calls it for every event."""
        read = operator.attrgetter(*(column.event_field for column in self.columns))
        converts = [(i, c.to_clickhouse) for i, c in enumerate(self.columns) if c.to_clickhouse]

        def row(event: Any) -> tuple[Any, ...]:
            values = read(event)
            if not converts:
                return tuple(values)
            out = list(values)
            for i, convert in converts:
                out[i] = convert(out[i])
            return tuple(out)

        return row


DIM_LAYOUT_GROUP = Dimension(
    table="pin_dev_stats.dim_layout_group",
    columns=(
        Column("LayoutGroupId", "UUID", "id", None),
        Column("ProjectId", "UUID", "project_id", "project_id"),
        # DeveloperId = the event's TenantId: the project's developer (INV-DIM-LG-2), which the
        # reconciliation reads up the hierarchy (layout_group_sources).
        Column("DeveloperId", "UUID", "tenant_id", "developer_id"),
        Column("Name", "String", "name", "name"),
        Column("SortOrder", "Int32", "sort_order", "sort_order"),
        Column("IsArchived", "UInt8", "is_archived", "is_archived", to_clickhouse=int),
        # SourceVersion = Version, UpsertedAt = CreatedAt: the spec's mapping.
        Column("SourceVersion", "Int64", "version", "version"),
        Column("UpsertedAt", "DateTime64(3)", "created_at", None),
    ),
    key="LayoutGroupId",
    version="SourceVersion",
    upserted="UpsertedAt",
    scope="DeveloperId",
)
