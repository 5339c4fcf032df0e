"""Helpers shared by the domains' sensors: is a job already queued or running?"""

import dagster as dg

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
