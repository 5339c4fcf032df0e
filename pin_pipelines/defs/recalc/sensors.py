"""The 5-second worker tick of spec 000, as a sensor that launches drain runs only when needed."""

import os

import dagster as dg

from pin_pipelines.config import recalc_tick_seconds
from pin_pipelines.defs.common import (
    STOPPING_REASON,
    ending_soon,
    in_flight_records,
    instance_stopping,
)
from pin_pipelines.defs.recalc.jobs import DrainConfig, recalc_drain_job
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.errors import PinError
from pin_pipelines.recalc.drain import seconds_until_next_due

#: A row due within this many seconds is worth a launch now. Sensor ticks land 5–10 s apart and a
#: launch takes 3–7 s here, so a row first seen 7 s before its due time would otherwise be
#: drained ~10 s late; the run waits for it instead (drain_until_idle's wait_for_due_within).
LOOKAHEAD_SECONDS = 12.0
#: The name this sensor beats under (chessboard.recalc_scheduler_beats): liveness on an empty queue.
SCHEDULER_NAME = "recalc_queue_sensor"
#: A run in flight that leaves rows this overdue is not keeping up: a second one may join.
OVERDUE_SECONDS = 5.0


@dg.sensor(
    job=recalc_drain_job,
    minimum_interval_seconds=recalc_tick_seconds(os.environ),
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches recalc_drain_job when queue rows are due (or about to be).",
)
def recalc_queue_sensor(
    context: dg.SensorEvaluationContext, pin: PinSettings
) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    settings = pin.get()
    try:
        next_due = seconds_until_next_due(settings.pg_dsn, beat_as=SCHEDULER_NAME)
    except PinError as exc:
        return dg.SkipReason(f"queue unreadable: {exc}")
    if next_due is None:
        return dg.SkipReason("queue is empty")
    if next_due > LOOKAHEAD_SECONDS:
        return dg.SkipReason(f"next row is due in {next_due:.0f}s")
    # Concurrent drains are safe (SKIP LOCKED); more than a few only add launch overhead. The
    # run queue admits no more either (pin_pipelines/dagster_instance.py): one setting for both.
    max_runs = settings.recalc_max_drain_runs
    runs = in_flight_records(context, recalc_drain_job.name, limit=max_runs)
    # One run drains until idle; a second one joins when the first cannot keep up, or takes over
    # when the first is about to spend its budget (so its end costs no tick + launch delay).
    budget = DrainConfig().budget_seconds
    if runs and (
        len(runs) >= max_runs
        or (
            next_due > -OVERDUE_SECONDS
            and not all(
                ending_soon(r, "drain_recalc_queue", budget, LOOKAHEAD_SECONDS) for r in runs
            )
        )
    ):
        return dg.SkipReason(f"{len(runs)} drain run(s) already queued or running")
    return dg.RunRequest(tags={"pin/next_due_in": f"{next_due:.1f}"})
