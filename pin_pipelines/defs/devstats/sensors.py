"""Keeps the dim_layout_group loader running: a run whenever none is in flight (lag or not: it must
be there when events come), its successor shortly before its budget ends (the hand-over, see
assets.py), and on a ClickHouse server extra loads for a backlog."""

import dagster as dg

from pin_pipelines.defs.common import (
    STOPPING_REASON,
    budget_run_config,
    ending_soon,
    handover_seconds,
    in_flight_records,
    instance_stopping,
    launch_latencies,
)
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.devstats.freshness import unloaded_events
from pin_pipelines.errors import PinError

#: Unloaded events above which another load joins the running one(s): about ten batches.
BACKLOG_EVENTS = 10_000


@dg.sensor(
    job=dim_layout_group_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Keeps dim_layout_group loading: one long-lived load run, its successor near its end, "
        "and more for a backlog on a ClickHouse server (PIN_DEVSTATS_MAX_LOAD_RUNS)."
    ),
)
def dim_layout_group_sensor(
    context: dg.SensorEvaluationContext, pin: PinSettings
) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    settings = pin.get()
    try:
        lag = unloaded_events(settings)
    except PinError as exc:  # a load would only fail to join its group: launch none
        return dg.SkipReason(f"consumer lag unreadable: {exc}")
    max_runs = settings.devstats_max_load_runs
    runs = in_flight_records(context, dim_layout_group_job.name, limit=max_runs + 1)
    budget = settings.long_run_seconds  # the successor loads beside it until it ends
    run_config = budget_run_config("dim_layout_group", budget)
    margin = handover_seconds(launch_latencies(context.instance, dim_layout_group_job.name))
    staying = [r for r in runs if not ending_soon(r, "dim_layout_group", budget, margin)]
    tags = {"pin/unloaded_events": str(lag.events)}
    if not staying:
        if runs:  # every run in flight ends soon: its successor
            tags["pin/takes_over_from"] = runs[0].dagster_run.run_id
            tags["pin/handover_seconds"] = f"{margin:.1f}"
        return dg.RunRequest(run_config=run_config, tags=tags)
    # Loads are consumers of one group: each more splits the partitions (on a ClickHouse server;
    # one on chdb, config.py). Another one joins only for a backlog, since each join costs a
    # rebalance. The run queue admits no more than this (+ a successor: dagster_instance.py).
    if len(staying) < max_runs and lag.events >= BACKLOG_EVENTS:
        return dg.RunRequest(run_config=run_config, tags=tags)
    return dg.SkipReason(f"{len(staying)} load(s) already queued or running")
