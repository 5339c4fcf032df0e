"""Shared by every domain's definitions: is a job already queued or running, is `pin serve`
stopping, and the one way the project declares a schedule."""

from pathlib import Path

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def in_flight_records(
    context: dg.SensorEvaluationContext, job_name: str, limit: int = 5
) -> list[dg.RunRecord]:
    return list(
        context.instance.get_run_records(
            dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=limit
        )
    )


def runs_in_flight(context: dg.SensorEvaluationContext, job_name: str, limit: int = 5) -> int:
    return len(in_flight_records(context, job_name, limit))


#: `pin serve` writes this file into DAGSTER_HOME when it is asked to stop: sensors launch nothing
#: more and a drain ends after the project in hand, and `pin serve` stops the daemon only once no
#: run is in flight, so a clean stop leaves no run in FAILURE (issue 15). Removed at each start.
STOPPING_MARKER = "pin-serve-stopping"
STOPPING_REASON = "pin serve is stopping: no new runs"


def instance_stopping(instance: dg.DagsterInstance) -> bool:
    return (Path(instance.root_directory) / STOPPING_MARKER).exists()


def running_schedule(
    *,
    job: dg.JobDefinition | UnresolvedAssetJobDefinition,
    cron: str,
    description: str,
    name: str | None = None,
) -> dg.ScheduleDefinition:
    """A schedule of the project: on from the start (UTC), and launching nothing while `pin serve`
    stops. Without a name, Dagster names it `<job>_schedule`."""
    return dg.ScheduleDefinition(
        name=name,
        job=job,
        cron_schedule=cron,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=description,
        should_execute=lambda context: not instance_stopping(context.instance),
    )
