"""The drain's counters, written where it counts: inside each project's work transaction (one
outcome row, `record_recalc_outcome` in sql/postgres/schema/metrics.sql, called by
`recalc_project_step`, and by `recalc_tick` for a lock wait on the claimed row or the statement
timeout, both in schema/recalc.sql), so a
rolled-back project counts nothing, a committed one exactly once, and the count survives the
process; folded into the counters at each tick's end, with the tick's liveness (`record_tick`).
The exporter (`pin_pipelines.metrics`) only reads them, with the label values below."""

from __future__ import annotations

import psycopg

from pin_pipelines.db import queries
from pin_pipelines.sql_faces import RecalcQueries

Q = queries("recalc", RecalcQueries)

#: The drain's outcomes as `chessboard_recalc_runs_total{result}` values, as recalc_project_step
#: and recalc_tick write them (sql/postgres/schema/recalc.sql); "error" is the spec's name for a
#: failed run (alert "рост runs_total{result=error}"). An interrupted attempt was given
#: back, so it is not a run.
RESULT_LABELS: dict[str, str] = {
    "recalculated": "success",
    "skipped_archived": "skipped_archived",
    "failed": "error",
    "deferred": "deferred",
}
#: `chessboard_recalc_republished_total{entity}` values: the drain's republished keys.
ENTITIES = ("project", "layout", "layout_group")


def record_tick(conn: psycopg.Connection) -> None:
    """A tick's end: the projects' outcome rows folded into the counters, and worker liveness
    (one drain tick happened now, also when nothing was due)."""
    Q.fold_recalc_outcomes(conn)
    Q.record_tick(conn)
