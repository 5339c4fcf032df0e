"""Counter writes, each a named query of `sql/postgres/queries/metrics.sql` run on the caller's
connection, inside the caller's transaction: a rolled-back project counts nothing, a committed
one exactly once, and the count survives the process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from pin_pipelines.db import queries

if TYPE_CHECKING:
    from pin_pipelines.recalc.drain import ProjectResult

#: The drain's outcomes as `chessboard_recalc_runs_total{result}` values; "error" is the spec's
#: name for a failed run (alert "рост runs_total{result=error}").
RESULT_LABELS: dict[str, str] = {
    "recalculated": "success",
    "skipped_archived": "skipped_archived",
    "failed": "error",
    "deferred": "deferred",
}
#: `chessboard_recalc_republished_total{entity}` values: the drain's republished keys.
ENTITIES = ("project", "layout", "layout_group")


def _q() -> Any:
    return queries("metrics")


def record_outcome(conn: psycopg.Connection, result: ProjectResult) -> None:
    """Count one claimed project. A deferred project (row lock held elsewhere) is counted as a
    run but not observed in the duration histogram: its time is lock waiting, not the recalc
    whose p99 the SLO bounds."""
    _q().record_recalc_outcome(
        conn,
        result=RESULT_LABELS[result.outcome],
        duration=None if result.outcome == "deferred" else result.duration_seconds,
        coalesced=result.requested_count,
        **{entity: result.republished.get(entity, 0) for entity in ENTITIES},
    )


def record_tick(conn: psycopg.Connection) -> None:
    """Worker liveness: one drain tick happened now (also when nothing was due)."""
    _q().record_tick(conn)


def record_loader_batch(conn: psycopg.Connection, *, inserted: int, skipped_stale: int) -> None:
    """The dimension loader's ClickHouse outcome of one batch (call after its offset commit)."""
    _q().record_loader_batch(conn, inserted=inserted, skipped_stale=skipped_stale)
