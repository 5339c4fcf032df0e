"""The hand-over margin of the long-lived runs follows the measured launch latency:
a successor launched a fixed 20 s before its predecessor's end started too late once a launch
took longer than that, leaving the relay's or the loader's leg without a run."""

from __future__ import annotations

import time

import dagster as dg
from dagster._core.events import DagsterEvent, DagsterEventType

from pin_pipelines.config import MIN_LONG_RUN_SECONDS
from pin_pipelines.defs.handover import (
    HANDOVER_SECONDS,
    HANDOVER_SLACK_SECONDS,
    MAX_HANDOVER_SECONDS,
    handover_seconds,
    launch_latencies,
)


def test_the_margin_is_the_launch_p99_plus_slack_within_its_bounds() -> None:
    assert handover_seconds([]) == HANDOVER_SECONDS  # nothing measured yet
    assert handover_seconds([1.0, 2.0, 3.0]) == HANDOVER_SECONDS  # fast launches
    slow = [5.0] * 98 + [30.0, 31.0]
    assert handover_seconds(slow) == 31.0 + HANDOVER_SLACK_SECONDS
    assert handover_seconds([120.0]) == MAX_HANDOVER_SECONDS  # the relay lock's bound
    # The shortest run the settings admit (PIN_LONG_RUN_SECONDS) outlasts the longest margin: a
    # run's successor is never due the moment the run starts.
    assert MIN_LONG_RUN_SECONDS > MAX_HANDOVER_SECONDS


@dg.op
def _noop() -> None:
    pass


@dg.job
def _measured_job() -> None:
    _noop()


def test_launch_latencies_are_created_to_started_of_the_runs_that_started() -> None:
    """Tried: three runs of a job, two started 0.3 s after their creation and one never started.
    The latencies are the two started runs', about 0.3 s each."""
    with dg.DagsterInstance.ephemeral() as instance:
        created = [instance.create_run_for_job(job_def=_measured_job) for _ in range(3)]
        time.sleep(0.3)
        for run in created[:2]:
            instance.report_dagster_event(
                DagsterEvent(DagsterEventType.RUN_START.value, job_name=run.job_name),
                run_id=run.run_id,
            )
        latencies = launch_latencies(instance, _measured_job.name)
    assert len(latencies) == 2, latencies
    assert all(0.3 <= seconds < 5.0 for seconds in latencies), latencies
    assert latencies == sorted(latencies)
