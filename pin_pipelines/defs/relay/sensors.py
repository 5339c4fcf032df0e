"""Keeps one relay run going: launches one when none is in flight, and its successor shortly
before the run in flight spends its budget (the hand-over, see jobs.py)."""

import dagster as dg

from pin_pipelines.db import connection
from pin_pipelines.defs.common import (
    STOPPING_REASON,
    budget_run_config,
    ending_soon,
    handover_seconds,
    in_flight_records,
    instance_stopping,
    launch_latencies,
)
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.errors import PinError
from pin_pipelines.relay.metrics import relay_lag


@dg.sensor(
    job=outbox_relay_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps outbox_relay_job running: one relay run, and its successor near its end.",
)
def outbox_relay_sensor(
    context: dg.SensorEvaluationContext, pin: PinSettings
) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    settings = pin.get()
    try:
        with connection(settings.pg_dsn) as conn:
            backlog = relay_lag(conn)
    except PinError as exc:
        return dg.SkipReason(f"outbox unreadable: {exc}")
    runs = in_flight_records(context, outbox_relay_job.name, limit=2)
    # The successor waits on the relay lock for the rest of the run in flight (less than its
    # 60 s lock_timeout).
    budget = settings.long_run_seconds
    run_config = budget_run_config("relay_outbox", budget)
    margin = handover_seconds(launch_latencies(context.instance, outbox_relay_job.name))
    if len(runs) == 1 and ending_soon(runs[0], "relay_outbox", budget, margin):
        return dg.RunRequest(
            run_config=run_config,
            tags={
                "pin/outbox_pending": str(backlog["pending"]),
                "pin/takes_over_from": runs[0].dagster_run.run_id,
                "pin/handover_seconds": f"{margin:.1f}",
            },
        )
    if runs:
        return dg.SkipReason(f"{len(runs)} relay run(s) already queued or running")
    return dg.RunRequest(
        run_config=run_config, tags={"pin/outbox_pending": str(backlog["pending"])}
    )
