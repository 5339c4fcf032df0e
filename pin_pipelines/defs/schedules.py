"""The one way the project declares a schedule: of a job, or of an asset check alone; on from
the start, and launching nothing while `pin serve` stops."""

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from pin_pipelines.defs.stopping import instance_stopping


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


def check_schedule(
    *checks: dg.AssetChecksDefinition,
    job_name: str,
    cron: str,
    description: str,
    name: str | None = None,
) -> dg.ScheduleDefinition:
    """A running_schedule of a job `job_name` that evaluates `checks` alone, in one run: checks
    that must also run when no materialization does (Definitions picks the job up from the
    schedule). Checks of one cadence share a run: each run starts a worker process and its
    compute-log helpers, at rest too."""
    return running_schedule(
        name=name,
        job=dg.define_asset_job(
            job_name, selection=dg.AssetSelection.checks(*checks), description=description
        ),
        cron=cron,
        description=description,
    )
