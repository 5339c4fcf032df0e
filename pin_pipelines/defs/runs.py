"""Helpers shared by the domains' sensors: is a job already queued or running?"""

import dagster as dg

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def runs_in_flight(context: dg.SensorEvaluationContext, job_name: str, limit: int = 5) -> int:
    records = context.instance.get_run_records(
        dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=limit
    )
    return len(records)
