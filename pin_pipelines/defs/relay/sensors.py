"""Launches the relay when the outbox holds events and no relay run is in flight."""

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.defs.common import STOPPING_REASON, instance_stopping, runs_in_flight
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.errors import PinError
from pin_pipelines.relay.metrics import relay_lag


@dg.sensor(
    job=outbox_relay_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches outbox_relay_job while chessboard.outbox_events is not empty.",
)
def outbox_relay_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    try:
        with connection(Settings.from_env().pg_dsn) as conn:
            backlog = relay_lag(conn)
    except PinError as exc:
        return dg.SkipReason(f"outbox unreadable: {exc}")
    if not backlog["pending"]:
        return dg.SkipReason("outbox is empty")
    if runs_in_flight(context, outbox_relay_job.name):
        return dg.SkipReason("a relay run is already queued or running")
    return dg.RunRequest(tags={"pin/outbox_pending": str(backlog["pending"])})
