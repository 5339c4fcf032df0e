"""The operator side of `pin_dev_stats.dim_layout_group`: the loader's write and version guard
(every developer's groups), and reads for a developer the caller names. The SQL is in
`sql/clickhouse/queries/dim_layout_group.sql`.

The developer-scoped online reads are `devstats/reads.py`, which takes an `Actor` (spec 003,
security: every query filters `DeveloperId` = the actor). This module sees every developer, so
the read API may not import it (tests/unit/test_layering.py); its `labels` and `groups` are the
online reads with an Actor from the operator's explicit door (`devstats/operator.py`), for the
tests and benches that name developers freely. Every read takes a group's current row by
(UpsertedAt, SourceVersion): the query files say why.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from uuid import UUID

from pin_pipelines.clickhouse import CLICKHOUSE_SQL_DIR, ClickHouse, UuidSet, named_queries
from pin_pipelines.devstats import reads
from pin_pipelines.devstats.actor import Actor
from pin_pipelines.devstats.events import COLUMNS, LayoutGroupUpserted
from pin_pipelines.devstats.operator import operator_actor
from pin_pipelines.devstats.reads import LayoutGroup

TABLE = "pin_dev_stats.dim_layout_group"
QUERIES = named_queries(CLICKHOUSE_SQL_DIR / "queries" / "dim_layout_group.sql")


def stored_versions(ch: ClickHouse, ids: Collection[UUID]) -> dict[int, int]:
    """The current SourceVersion of each stored group among `ids` (absent ones are missing),
    keyed by the group's UUID as an int, like `newest_per_group`."""
    if not ids:
        return {}
    found = ch.records(QUERIES["stored_versions"], {"ids": UuidSet(ids)})
    # UUIDs (the ClickHouse interface's type)
    return {row["layout_group_id"].int: int(row["source_version"]) for row in found}


def insert_events(ch: ClickHouse, events: Iterable[LayoutGroupUpserted]) -> int:
    """One insert for the whole batch, sent: stored once `ch.confirm_insert()` (or the client's
    next statement) returns. The dedup token hashes the (group, version) pairs, which identify
    the rows, so a retry of the same batch is recognised where inserts are deduplicated (and is
    not computed where they are not)."""
    batch = list(events)
    token = None
    if ch.deduplicates_inserts:
        digest = hashlib.sha256()
        for event in batch:
            digest.update(event.id.bytes + event.version.to_bytes(8, "big"))
        token = digest.hexdigest()
    ch.send_insert(TABLE, COLUMNS, [event.row() for event in batch], dedup_token=token)
    return len(batch)


def labels(
    ch: ClickHouse, developer_id: UUID, ids: Iterable[UUID], project_id: UUID | None = None
) -> dict[str, str]:
    """`reads.labels` for `developer_id`, named by the caller (an operator's read)."""
    return reads.labels(ch, _operator(developer_id), ids, project_id)


def groups(ch: ClickHouse, developer_id: UUID, project_id: UUID | None = None) -> list[LayoutGroup]:
    """`reads.groups` for `developer_id`, named by the caller (an operator's read)."""
    return reads.groups(ch, _operator(developer_id), project_id)


def _operator(developer_id: UUID | str) -> Actor:
    """These reads took any UUID-like developer id (scripts pass the text of one)."""
    return operator_actor(UUID(str(developer_id)))
