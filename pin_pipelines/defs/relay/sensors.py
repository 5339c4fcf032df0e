"""Keeps one relay run going: launches one when none is in flight, and its successor shortly
before the run in flight spends its budget (the hand-over, see jobs.py)."""

import time
from typing import Any

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.defs.common import STOPPING_REASON, in_flight_records, instance_stopping
from pin_pipelines.defs.relay.jobs import RelayConfig, outbox_relay_job
from pin_pipelines.errors import PinError
from pin_pipelines.relay.metrics import relay_lag

#: The successor is launched this long before the run in flight ends: a launch takes 3–10 s on
#: this machine, and the successor waits on the relay lock for the rest (less than its 60 s
#: lock_timeout).
HANDOVER_SECONDS = 20.0


@dg.sensor(
    job=outbox_relay_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps outbox_relay_job running: one relay run, and its successor near its end.",
)
def outbox_relay_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    try:
        with connection(Settings.from_env().pg_dsn) as conn:
            backlog = relay_lag(conn)
    except PinError as exc:
        return dg.SkipReason(f"outbox unreadable: {exc}")
    runs = in_flight_records(context, outbox_relay_job.name, limit=2)
    if len(runs) == 1 and _ending_soon(runs[0]):
        return dg.RunRequest(
            tags={
                "pin/outbox_pending": str(backlog["pending"]),
                "pin/takes_over_from": runs[0].dagster_run.run_id,
            }
        )
    if runs:
        return dg.SkipReason(f"{len(runs)} relay run(s) already queued or running")
    return dg.RunRequest(tags={"pin/outbox_pending": str(backlog["pending"])})


def _ending_soon(record: dg.RunRecord) -> bool:
    """A started run within HANDOVER_SECONDS of its budget (its own config, or the default)."""
    if record.start_time is None:
        return False
    run_config: dict[str, Any] = dict(record.dagster_run.run_config)
    op_config = run_config.get("ops", {}).get("relay_outbox", {}).get("config", {})
    budget = float(op_config.get("budget_seconds", RelayConfig().budget_seconds))
    return time.time() - record.start_time > budget - HANDOVER_SECONDS
