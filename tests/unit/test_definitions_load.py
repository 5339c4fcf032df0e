"""The code location loads (contract section 6) — without any running service."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_code_location_holds_the_recalc_jobs_and_the_5_second_sensor():
    """pin_pipelines.definitions.defs loads and validates, and holds recalc_drain_job, the
    recalc_queue_sensor targeting it every 5 s, force_recalc_job and requeue_poisoned_job."""
    from pin_pipelines.definitions import defs

    dg.Definitions.validate_loadable(defs)
    for name in ("recalc_drain_job", "force_recalc_job", "requeue_poisoned_job"):
        assert defs.resolve_job_def(name).name == name
    sensor = defs.resolve_sensor_def("recalc_queue_sensor")
    assert sensor.minimum_interval_seconds == 5
    assert sensor.job_name == "recalc_drain_job"


def test_dagster_validates_the_workspace(tmp_path):
    """`dagster definitions validate -w workspace.yaml` from the repository root, with an empty
    DAGSTER_HOME: exit code 0."""
    dagster = Path(sys.executable).with_name("dagster")
    proc = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO_ROOT,
        env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_each_load_runs_the_freshness_check_but_not_the_versions_check():
    """The versions check reads every group from both stores: it has its own 10-minute schedule
    instead of running with each load (every few seconds)."""
    from pin_pipelines.definitions import defs

    def checks_of(job: str) -> set[str]:
        graph = defs.resolve_job_def(job).asset_layer.asset_graph
        return {key.name for key in graph.asset_check_keys}

    assert checks_of("dim_layout_group_job") == {"dim_layout_group_fresh"}
    schedule = defs.resolve_schedule_def("dim_layout_group_versions_schedule")
    assert checks_of(schedule.job_name) == {"dim_layout_group_versions_current"}
    assert schedule.cron_schedule == "*/10 * * * *"
