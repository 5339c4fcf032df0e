"""Retention of finished Dagster runs on a real PostgreSQL-backed Dagster instance:
run and event storage in a database of its own on the test server, compute logs on disk."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import psycopg
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)

from pin_pipelines.housekeeping import RetentionPolicy, prune_runs

S = dg.DagsterRunStatus
JOB = "recalc_drain_job"
ORIGIN = RemoteJobOrigin(
    repository_origin=RemoteRepositoryOrigin(
        code_location_origin=RegisteredCodeLocationOrigin("pin_pipelines"),
        repository_name="__repository__",
    ),
    job_name=JOB,
)


def _run(
    pg_instance: dg.DagsterInstance, dagster_db: str, status: dg.DagsterRunStatus, days_ago: float
) -> str:
    """A run with two event-log rows and a captured stdout file, last updated `days_ago`."""
    run = pg_instance.add_run(
        dg.DagsterRun(job_name=JOB, status=status, remote_job_origin=ORIGIN)  # queued needs one
    )
    for message in ("drain summary", "done"):
        pg_instance.report_engine_event(message, run)
    manager = pg_instance.compute_log_manager
    path = Path(manager.get_captured_local_path([run.run_id, "compute_logs", "op"], "out"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"event": "project_recalculated"}\n' * 10)
    with psycopg.connect(dagster_db, autocommit=True) as conn:
        conn.execute(
            "UPDATE runs SET update_timestamp = (now() AT TIME ZONE 'UTC')"
            " - make_interval(secs => %s) WHERE run_id = %s",
            (days_ago * 86400, run.run_id),
        )
    return run.run_id


def _left(pg_instance: dg.DagsterInstance, run_ids: list[str]) -> set[str]:
    present = {r.dagster_run.run_id for r in pg_instance.get_run_records()}
    return {run_id for run_id in run_ids if run_id in present}


def test_retention_deletes_old_finished_runs_with_their_logs_and_keeps_the_rest(
    pg_instance, dagster_db
):
    """Tried: finished and unfinished runs of every age. The default policy (3 days for
    successes, 14 for failures and cancels) deletes a 4-day-old success, a 15-day-old failure
    and a 15-day-old cancel, with their event-log rows and compute logs; it keeps a 1-day-old
    success, a 5-day-old failure and queued/started/canceling runs however old. A dry run
    before counts exactly that and deletes nothing."""
    deleted = [
        _run(pg_instance, dagster_db, S.SUCCESS, 4),
        _run(pg_instance, dagster_db, S.FAILURE, 15),
        _run(pg_instance, dagster_db, S.CANCELED, 15),
    ]
    kept = [
        _run(pg_instance, dagster_db, S.SUCCESS, 1),
        _run(pg_instance, dagster_db, S.FAILURE, 5),
        _run(pg_instance, dagster_db, S.QUEUED, 30),
        _run(pg_instance, dagster_db, S.STARTED, 30),
        _run(pg_instance, dagster_db, S.CANCELING, 30),
    ]
    policy = RetentionPolicy()

    dry = prune_runs(pg_instance, policy, dry_run=True)
    assert (dry.runs, dry.runs_by_status) == (3, {"SUCCESS": 1, "FAILURE": 1, "CANCELED": 1})
    assert dry.events is not None and dry.events >= 6
    assert dry.compute_log_bytes == 3 * 10 * len('{"event": "project_recalculated"}\n')
    assert _left(pg_instance, deleted + kept) == set(deleted + kept)

    done = prune_runs(pg_instance, policy)
    assert done.as_dict() == {**dry.as_dict(), "dry_run": False}
    assert _left(pg_instance, deleted + kept) == set(kept)
    for run_id in deleted:
        assert pg_instance.all_logs(run_id) == []
        assert not (Path(pg_instance.compute_log_manager._base_dir) / run_id).exists()
    for run_id in kept:
        assert len(pg_instance.all_logs(run_id)) == 2
        assert (Path(pg_instance.compute_log_manager._base_dir) / run_id).exists()
    assert prune_runs(pg_instance, policy).runs == 0


def test_retention_is_bounded_per_call_and_says_when_more_is_left(pg_instance, dagster_db):
    """Tried: five old successes with max_runs 2 and batches of 1: each call deletes two and
    reports more_left until the last one."""
    runs = [_run(pg_instance, dagster_db, S.SUCCESS, 10) for _ in range(5)]
    policy = RetentionPolicy(max_runs=2, batch_size=1)
    calls = [prune_runs(pg_instance, policy) for _ in range(3)]
    assert [(c.runs, c.more_left) for c in calls] == [(2, True), (2, True), (1, False)]
    assert _left(pg_instance, runs) == set()


def test_the_daily_job_prunes_with_the_settings_and_is_shipped_on(
    pg_instance, dagster_db, monkeypatch
):
    """Tried: PIN_DAGSTER_RETENTION_SUCCESS_DAYS=0.5 and the shipped job run on the instance:
    a 1-day-old success goes, a fresh one and the job's own run stay; the daily schedule that
    launches it is on by default."""
    from pin_pipelines.definitions import defs
    from pin_pipelines.defs.housekeeping.jobs import dagster_retention_schedule
    from pin_pipelines.defs.resources import RESOURCES

    monkeypatch.setenv("PIN_DAGSTER_RETENTION_SUCCESS_DAYS", "0.5")
    old, fresh = (
        _run(pg_instance, dagster_db, S.SUCCESS, 1),
        _run(pg_instance, dagster_db, S.SUCCESS, 0.1),
    )
    job = defs.get_job_def("dagster_retention_job")
    result = job.execute_in_process(instance=pg_instance, resources=RESOURCES)
    assert result.success
    assert _left(pg_instance, [old, fresh, result.run_id]) == {fresh, result.run_id}
    assert dagster_retention_schedule.default_status == dg.DefaultScheduleStatus.RUNNING


def test_pin_dagster_prune_counts_then_deletes_with_a_json_summary(
    pg_instance, dagster_db, pg_dsn, tmp_path
):
    """Tried: `pin dagster prune --dry-run`, then `pin dagster prune`, as an operator runs them on
    the instance's DAGSTER_HOME: the dry run counts the 4-day-old success and deletes nothing, the
    real one deletes it; each prints the contract's JSON summary last."""
    import os
    import subprocess

    from tests.support.recalc import PIN, REPO_ROOT, last_json_line
    from tests.support.serve import storage_url

    old = _run(pg_instance, dagster_db, S.SUCCESS, 4)
    env = {
        **os.environ,
        "PIN_PG_DSN": pg_dsn,
        "DAGSTER_HOME": str(tmp_path / "prune_home"),
        "PIN_DAGSTER_PG_URL": storage_url(dagster_db),
    }
    summaries = []
    for args in (["--dry-run"], []):
        done = subprocess.run(
            [PIN, "dagster", "prune", *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        summaries.append(last_json_line(done.stdout))
        assert _left(pg_instance, [old]) == (set() if not args else {old})
    assert [(s["dry_run"], s["runs"]) for s in summaries] == [(True, 1), (False, 1)]
    assert summaries[1]["bytes_freed"] > 0 and summaries[1]["events"] >= 2
