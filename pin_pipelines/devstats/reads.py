"""The dimension's online reads, each for one `Actor` (spec 003's DevStats.Api reads); the SQL is in
`sql/clickhouse/queries/dim_layout_group_reads.sql`.

Every read filters `DeveloperId` = the actor (spec 003, security) and, when given, the project
(`WHERE DeveloperId = actor AND ProjectId = … AND LayoutGroupId = …`), both on a group's current
row: a group moved to another developer is the new one's at once, merged or not. They take an
`Actor`, never a developer id: who the developer is was settled by the door that made the Actor
(a verified token, or the operator's explicit door), not by the caller's arguments
(devstats/actor.py).
tests/unit/test_api_actor.py fails if a read of this module takes anything else. The reads that
see every developer (the loader's version guard, the reconciliation) are in devstats/dim.py,
which the read API cannot import.

Every read takes a group's current row by (UpsertedAt, SourceVersion): the query file says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from pin_pipelines.clickhouse import CLICKHOUSE_SQL_DIR, ClickHouse, UuidSet, named_queries
from pin_pipelines.devstats.actor import Actor

QUERIES = named_queries(CLICKHOUSE_SQL_DIR / "queries" / "dim_layout_group_reads.sql")


@dataclass(frozen=True)
class LayoutGroup:
    """The current row of a group as an actor sees it."""

    layout_group_id: UUID
    project_id: UUID
    name: str
    sort_order: int
    is_archived: bool
    source_version: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> LayoutGroup:
        """From a row of `groups`, by its names."""
        return cls(
            layout_group_id=UUID(str(row["layout_group_id"])),
            project_id=UUID(str(row["project_id"])),
            name=str(row["name"]),
            sort_order=int(row["sort_order"]),
            is_archived=bool(row["is_archived"]),
            source_version=int(row["source_version"]),
        )


def labels(
    ch: ClickHouse, actor: Actor, ids: Iterable[UUID], project_id: UUID | None = None
) -> dict[str, str]:
    """`{layout_group_id: Name}`; a missing group, one whose current row is another
    developer's, or (with
    `project_id`) one whose current row is in another project is labelled with its own id (the
    spec's degradation, no error): the three look the same, so an answer tells nothing about
    other developers' groups.

    The ids go as a UuidSet, like the guard's: through a Distributed table the entry server
    otherwise parses 1,000 UUID literals and each shard parses them again (measured on the local
    18.16 cluster: p50 42 ms with literals, 10 ms as an external table; 12 vs 8 ms on one
    server)."""
    developer_id = _scope(actor)
    wanted = list(dict.fromkeys(ids))  # each id once, in the order asked
    if not wanted:
        return {}
    found: dict[UUID, str] = {
        row["layout_group_id"]: str(row["name"])
        for row in ch.records(
            QUERIES["labels"],
            {"developer_id": developer_id, "ids": UuidSet(wanted), "project_id": project_id},
        )
    }
    return {str(gid): found[gid] if gid in found else str(gid) for gid in wanted}


def groups(ch: ClickHouse, actor: Actor, project_id: UUID | None = None) -> list[LayoutGroup]:
    """The actor's groups in display order (SortOrder, then the id's text), archived ones
    included; with
    `project_id`, only the groups whose current row is in that project (none for a project of
    another developer: it holds no group of the actor's)."""
    developer_id = _scope(actor)
    return [
        LayoutGroup.of(row)
        for row in ch.records(
            QUERIES["groups"], {"developer_id": developer_id, "project_id": project_id}
        )
    ]


def readable(ch: ClickHouse) -> None:
    """Raises unless the dimension can be read (the read API's /healthz and its start). It reads
    no row of anybody's (the query counts the nil id), so it needs no Actor."""
    ch.rows(QUERIES["readable"])


def _scope(actor: Actor) -> UUID:
    """The developer a read filters on. Checked at run time too: an untyped caller passing a
    developer id instead of an Actor fails here instead of reading that developer's rows."""
    if not isinstance(actor, Actor):
        raise TypeError(f"the dimension's online reads take an Actor, got {type(actor).__name__}")
    return actor.developer_id
