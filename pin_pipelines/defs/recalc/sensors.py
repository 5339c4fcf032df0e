"""The 5-second worker tick of spec 000, as a sensor that launches drain runs only when needed."""

import os
from collections.abc import Callable

import dagster as dg

from pin_pipelines.config import Settings, recalc_tick_seconds
from pin_pipelines.defs.recalc.jobs import DrainConfig, recalc_drain_job
from pin_pipelines.defs.sensors import Decision, ending_soon, in_flight_records, worker_sensor
from pin_pipelines.recalc import seconds_until_next_due

#: A row due within this many seconds is worth a launch now. Sensor ticks land 5–10 s apart and a
#: launch takes 3–7 s here, so a row first seen 7 s before its due time would otherwise be
#: drained ~10 s late; the run waits for it instead (drain_until_idle's wait_for_due_within).
LOOKAHEAD_SECONDS = 12.0
#: The name this sensor beats under (chessboard.recalc_scheduler_beats): liveness on an empty queue.
SCHEDULER_NAME = "recalc_queue_sensor"
#: A run in flight that leaves rows this overdue is not keeping up: a second one may join.
OVERDUE_SECONDS = 5.0


def _next_due(settings: Settings) -> float | None:
    """Seconds until the next row is due (None: nothing queued but poison); the read is the
    scheduler's beat too."""
    return seconds_until_next_due(settings.pg_dsn, beat_as=SCHEDULER_NAME)


def _drain_runs_wanted(
    context: dg.SensorEvaluationContext,
    settings: Settings,
    read_next_due: Callable[[], float | None],
) -> Decision:
    next_due = read_next_due()  # every tick: the spec's tick, and the scheduler's beat
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


recalc_queue_sensor = worker_sensor(
    name="recalc_queue_sensor",
    job=recalc_drain_job,
    minimum_interval_seconds=recalc_tick_seconds(os.environ),
    description="Launches recalc_drain_job when queue rows are due (or about to be).",
    read=_next_due,
    unreadable="queue unreadable",
    decide=_drain_runs_wanted,
)
