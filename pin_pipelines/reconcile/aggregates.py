"""Drift of the denormalized aggregates (spec 000 runbook "расхождение денормализации"): the
stored counters and bounds of every non-archived project compared with a truth computed from
property_objects/layouts by SQL written apart from the drain's (sql/postgres/queries/reconcile.sql).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID

import psycopg

from pin_pipelines.db import connection, fetch_all, fetch_one, queries
from pin_pipelines.recalc import RecalcReason, force_request
from pin_pipelines.reconcile.model import DriftRow
from pin_pipelines.sql_faces import ReconcileQueries

ENTITIES = ("project", "building", "layout", "layout_group")

Q = queries("reconcile", ReconcileQueries)


@dataclass(frozen=True)
class _CheckedCounts:
    """Rows per entity that the aggregate check covers (aggregate_checked_counts)."""

    project: int
    building: int
    layout: int
    layout_group: int


@dataclass(frozen=True)
class _QueueState:
    """A drifted project's queue row (queue_state)."""

    project_id: UUID
    poisoned: bool


@dataclass
class AggregateDrift:
    """`checked`/`drifted` count rows per entity; a project is drifted when any of its rows is."""

    checked: dict[str, int]
    rows: list[DriftRow] = field(default_factory=list)
    #: Drifted projects that already have a queue row: they heal on the next drain by themselves.
    queued: set[UUID] = field(default_factory=set)
    #: Drifted projects whose queue row is parked as poison: a drain will not fix them.
    poisoned: set[UUID] = field(default_factory=set)

    @property
    def drifted(self) -> dict[str, int]:
        ids = {(r.entity, r.id) for r in self.rows}
        counts = Counter(entity for entity, _ in ids)
        return {entity: counts[entity] for entity in ENTITIES}

    @property
    def drifted_columns(self) -> dict[str, int]:
        return dict(sorted(Counter(f"{r.entity}.{r.column}" for r in self.rows).items()))

    @property
    def project_ids(self) -> list[UUID]:
        """Every project with drift anywhere in its hierarchy, in id order (the repair's lock
        order)."""
        return sorted({r.project_id for r in self.rows if r.project_id is not None}, key=str)

    @property
    def unexplained(self) -> list[UUID]:
        """Drifted projects nothing will repair: not queued, or queued but poisoned."""
        return [p for p in self.project_ids if p not in self.queued or p in self.poisoned]

    def summary(self) -> dict[str, Any]:
        return {
            "projects_checked": self.checked["project"],
            "projects_drifted": len(self.project_ids),
            "projects_drifted_queued": len(self.queued - self.poisoned),
            "projects_drifted_poisoned": len(self.poisoned),
            "rows_checked": self.checked,
            "rows_drifted": self.drifted,
            "columns_drifted": self.drifted_columns,
        }


def aggregates_drift(dsn: str) -> AggregateDrift:
    """One consistent snapshot (REPEATABLE READ, read only): counts and drift agree."""
    with connection(dsn) as conn:
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            counts = fetch_one(Q.aggregate_checked_counts, conn, _CheckedCounts)
            assert counts is not None  # an aggregate without GROUP BY: always one row
            rows = fetch_all(Q.aggregate_drift_cells, conn, DriftRow)
            checked = {entity: int(count) for entity, count in asdict(counts).items()}
            drift = AggregateDrift(checked=checked, rows=rows)
            if rows:
                for queued in fetch_all(
                    Q.queue_state, conn, _QueueState, project_ids=drift.project_ids
                ):
                    drift.queued.add(queued.project_id)
                    if queued.poisoned:
                        drift.poisoned.add(queued.project_id)
    return drift


def enqueue_projects(dsn: str, project_ids: list[UUID]) -> int:
    """Repair: each project's queue row becomes due now (the runbook's force-recalc, reason
    Reconcile) through the same named upsert as `pin recalc request`. One autocommit statement per
    project: no long transaction holds queue rows that writers' raisers need."""
    with connection(dsn, autocommit=True) as conn:
        for project_id in project_ids:
            force_request(conn, project_id, RecalcReason.RECONCILE)
    return len(project_ids)
