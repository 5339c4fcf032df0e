"""Materializes dim_layout_group every few seconds while the topic has unloaded events."""

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.defs.common import STOPPING_REASON, instance_stopping, runs_in_flight
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.devstats.freshness import unloaded_events
from pin_pipelines.errors import PinError

#: Unloaded events above which another load joins the running one(s): about ten batches.
BACKLOG_EVENTS = 10_000


#: A load at most every 30 s: the freshness SLA is 5 minutes, and a load launched on every
#: 5-second tick with events flowing was most of the Dagster instance's runs (issue 15:
#: bench/bench_dagster_storage.py).
LOAD_INTERVAL_SECONDS = 30


@dg.sensor(
    job=dim_layout_group_job,
    minimum_interval_seconds=LOAD_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a dim_layout_group load when the loader's consumer group lags.",
)
def dim_layout_group_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    try:
        settings = Settings.from_env()
        lag = unloaded_events(settings)
    except PinError as exc:
        return dg.SkipReason(f"consumer lag unreadable: {exc}")
    if not lag.events:
        return dg.SkipReason("dim_layout_group is up to date with the topic")
    # Loads are consumers of one group: each more splits the partitions (on a ClickHouse server;
    # one on chdb). A second one joins only for a backlog, since each join costs a rebalance. The
    # run queue admits no more than this either (pin_pipelines/dagster_instance.py).
    max_runs = settings.devstats_max_load_runs
    runs = runs_in_flight(context, dim_layout_group_job.name, limit=max_runs)
    if runs >= max_runs or (runs and lag.events < BACKLOG_EVENTS):
        return dg.SkipReason(f"{runs} load(s) already queued or running")
    return dg.RunRequest(tags={"pin/unloaded_events": str(lag.events)})
