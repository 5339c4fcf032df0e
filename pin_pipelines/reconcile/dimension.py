"""Drift of the dev-stats dimension dim_layout_group (spec 003) against chessboard.layout_groups,
and its repair through the dimension's normal path (outbox → Kafka → loader).

Why the repair bumps versions: the loader applies an event only when its Version is above the
stored SourceVersion, and ReplacingMergeTree(UpsertedAt) keeps the newest row. Re-publishing a
group at its current version would be skipped as stale whenever the dimension already holds that
version with other values (a lost rename, a row corrupted by hand). So each re-published group
gets version = max(PostgreSQL version, dimension version) + 1, written in the same transaction as
its outbox event while the group row is locked: the event is the key's newest Version, its
CreatedAt (clock time at repair) is the newest UpsertedAt, and a concurrent drain of the same
project waits on the project row lock, so per-key order holds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.db import connection, fetch_all, fetch_column, queries
from pin_pipelines.devstats.loading import DIM_LAYOUT_GROUP, DIM_QUERIES
from pin_pipelines.reconcile.model import DriftRow
from pin_pipelines.sql_faces import ReconcileQueries

ENTITY = "dim_layout_group"
#: Compared, in the table's order: the spec's dimension columns and the version, by the names the
#: dimension's description gives them (devstats/dimension.py).
COLUMNS = DIM_LAYOUT_GROUP.compared
#: Per group, the first that applies: the row is absent, present without a source group, behind,
#: ahead of the source (a restored database?), or at the same version with other values.
KINDS = ("missing", "unexpected", "stale_version", "ahead_version", "different")

Q = queries("reconcile", ReconcileQueries)


@dataclass(frozen=True)
class Snapshot:
    """A group's compared values, by name: what chessboard.layout_groups says the dimension
    should hold (`layout_group_sources`), or what it holds (`current_rows`). The fields are the
    description's compared names (tests/unit/test_dimension_description.py)."""

    project_id: UUID
    #: The project's developer: the hierarchy's, not the group's copy (layout_group_sources).
    developer_id: UUID
    name: str
    sort_order: int
    is_archived: bool
    version: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Snapshot:
        """From a row read by name (either side; a UUID may come as text, a flag as UInt8)."""
        return cls(
            project_id=UUID(str(row["project_id"])),
            developer_id=UUID(str(row["developer_id"])),
            name=str(row["name"]),
            sort_order=int(row["sort_order"]),
            is_archived=bool(row["is_archived"]),
            version=int(row["version"]),
        )

    def get(self, name: str) -> Any:
        return getattr(self, name)


@dataclass(frozen=True)
class _LayoutGroupSource(Snapshot):
    """A chessboard.layout_groups row as the dimension should hold it (layout_group_sources):
    the compared values, and the group's id."""

    id: UUID


@dataclass
class DimDrift:
    checked: int
    kinds: dict[UUID, str] = field(default_factory=dict)
    rows: list[DriftRow] = field(default_factory=list)
    #: Groups to re-publish, with the dimension's version (-1 when missing) as the bump floor.
    republish: dict[UUID, int] = field(default_factory=dict)
    #: project_id of each group to re-publish (the repair locks per project).
    projects: dict[UUID, UUID] = field(default_factory=dict)
    #: The database's clock before the dimension was read: what the relay recorded as beyond
    #: the source before it is in what was read (None: not read from the services).
    read_at: datetime | None = None

    @property
    def drifted(self) -> int:
        return len(self.kinds)

    @property
    def by_kind(self) -> dict[str, int]:
        counts = Counter(self.kinds.values())
        return {kind: counts[kind] for kind in KINDS}

    def summary(self) -> dict[str, Any]:
        return {
            "dim_rows_checked": self.checked,
            "dim_rows_drifted": self.drifted,
            "dim_drift_by_kind": self.by_kind,
        }


def compare(source: dict[UUID, Snapshot], dim: dict[UUID, Snapshot]) -> DimDrift:
    """Pure comparison, so every kind of drift is testable without services."""
    drift = DimDrift(checked=len(source.keys() | dim.keys()))
    for group_id in sorted(source.keys() | dim.keys(), key=str):
        want, have = source.get(group_id), dim.get(group_id)
        if want is None:
            assert have is not None
            drift.kinds[group_id] = "unexpected"
            drift.rows.append(
                DriftRow(ENTITY, group_id, have.project_id, "row", f"version {have.version}", None)
            )
            continue
        if have is None:
            kind = "missing"
            drift.rows.append(
                DriftRow(ENTITY, group_id, want.project_id, "row", None, f"version {want.version}")
            )
        else:
            diffs = [
                DriftRow(
                    ENTITY, group_id, want.project_id, column, have.get(column), want.get(column)
                )
                for column in COLUMNS
                if have.get(column) != want.get(column)
            ]
            if not diffs:
                continue
            drift.rows.extend(diffs)
            version_have, version_want = have.version, want.version
            kind = (
                "stale_version"
                if version_have < version_want
                else "ahead_version"
                if version_have > version_want
                else "different"
            )
        drift.kinds[group_id] = kind
        drift.republish[group_id] = -1 if have is None else have.version
        drift.projects[group_id] = want.project_id
    return drift


def dim_layout_group_drift(pg_dsn: str, ch: ClickHouse) -> DimDrift:
    """The dimension is read after PostgreSQL: an event relayed and loaded in between shows as
    `ahead_version` for one run at worst, never as a missing row."""
    with connection(pg_dsn) as conn:
        read_at = Q.clock(conn)
        source: dict[UUID, Snapshot] = {
            g.id: g for g in fetch_all(Q.layout_group_sources, conn, _LayoutGroupSource)
        }
    dim = {
        UUID(str(row["id"])): Snapshot.of(row) for row in ch.records(DIM_QUERIES["current_rows"])
    }
    drift = compare(source, dim)
    drift.read_at = read_at
    return drift


@dataclass(frozen=True)
class VersionsBehind:
    """Where the dimension has not caught up with chessboard.layout_groups."""

    checked: int
    #: Rows with a lower SourceVersion than the source's version.
    stale: list[UUID]
    #: Groups without a row. Not necessarily late: a new group is published once its project
    #: is drained (after the debounce), and a group that had no layouts before migration 0008
    #: only when its project is next drained (a repair publishes it at once).
    missing: list[UUID]
    #: Of both, the groups whose version was written longer ago than the grace: events that
    #: should have been visible by now.
    overdue: set[UUID]

    @property
    def stale_overdue(self) -> list[UUID]:
        return [g for g in self.stale if g in self.overdue]

    @property
    def missing_overdue(self) -> list[UUID]:
        return [g for g in self.missing if g in self.overdue]


def versions_behind(pg_dsn: str, ch: ClickHouse, grace_seconds: float) -> VersionsBehind:
    """The dimension's health as its asset check sees it. A group changed within the grace is
    normally on its way (outbox → Kafka → loader); the drift asset reports every other kind of
    difference."""
    drift = dim_layout_group_drift(pg_dsn, ch)
    stale = sorted((g for g, kind in drift.kinds.items() if kind == "stale_version"), key=str)
    missing = sorted((g for g, kind in drift.kinds.items() if kind == "missing"), key=str)
    overdue: set[UUID] = set()
    if stale or missing:
        with connection(pg_dsn) as conn:
            overdue = set(
                fetch_column(
                    Q.layout_groups_changed_before,
                    conn,
                    group_ids=stale + missing,
                    seconds=grace_seconds,
                )
            )
    return VersionsBehind(drift.checked, stale, missing, overdue)


def republish_layout_groups(pg_dsn: str, drift: DimDrift) -> int:
    """Repair: one transaction per project (project row lock first, as the drain takes it), each
    group's developer set to its project's where a bypassed trigger left another, its version
    bumped and its event written to the outbox. Returns the events written."""
    by_project: dict[UUID, list[UUID]] = defaultdict(list)
    for group_id in drift.republish:
        by_project[drift.projects[group_id]].append(group_id)
    written = 0
    with connection(pg_dsn, autocommit=True) as conn:
        for project_id in sorted(by_project, key=str):
            groups = sorted(by_project[project_id], key=str)
            with conn.transaction():
                Q.lock_project_for_republish(conn, project_id=project_id)
                Q.align_layout_group_tenants(conn, group_ids=groups)
                written += int(
                    Q.republish_layout_groups(
                        conn,
                        group_ids=groups,
                        floor_versions=[drift.republish[g] for g in groups],
                    )
                )
    return written


def clear_events_beyond_source(pg_dsn: str, drift: DimDrift) -> None:
    """After a repair: the events the relay found beyond the source (a failover) before the
    dimension was read are superseded, since every group whose row held such a Version was
    drifted and is now re-published above it."""
    if drift.read_at is None:
        return
    with connection(pg_dsn, autocommit=True) as conn:
        Q.clear_events_beyond_source(conn, before=drift.read_at)
