"""The event log of a run is O(1) rows, whatever the run processed (issue 15): per-project and
per-message lines go to the run's stdout (compute logs) as JSON lines, not to the event log."""

from __future__ import annotations

from collections import Counter

import dagster as dg
import psycopg

from pin_pipelines.definitions import defs
from pin_pipelines.defs.resources import RESOURCES
from tests.support.chessboard import make_building, make_layout, make_object, make_project


def _due_projects(conn: psycopg.Connection, count: int) -> None:
    for _ in range(count):
        project = make_project(conn)
        building = make_building(conn, project)
        make_object(conn, project, building, make_layout(conn, project, None, 30), status="Free")
    conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")


def _event_rows(instance: dg.DagsterInstance, run_id: str) -> Counter[str]:
    return Counter(
        e.dagster_event.event_type_value if e.dagster_event else "log_message"
        for e in instance.all_logs(run_id)
    )


def test_a_drain_run_writes_as_many_event_rows_for_30_projects_as_for_3(db, pg_instance, capfd):
    """Tried: recalc_drain_job on a PostgreSQL-backed instance over 3, then 30 due projects.
    Before issue 15 each project added its `project_recalculated` line to the event log (161
    rows for a drain run in production); now both runs write the same number of rows: the
    run's events, one summary line and the asset event; the per-project JSON lines are on the
    run's stdout (what Dagster captures as its compute logs)."""
    job = defs.get_job_def("recalc_drain_job")
    rows = []
    for projects in (3, 30):
        _due_projects(db, projects)
        result = job.execute_in_process(instance=pg_instance, resources=RESOURCES)
        assert result.success
        rows.append(_event_rows(pg_instance, result.run_id))
        stdout = capfd.readouterr().out
        assert stdout.count('"event": "project_recalculated"') == projects
    assert rows[0] == rows[1], rows
    assert sum(rows[1].values()) <= 20, rows[1]
