"""Materializes dim_layout_group every few seconds while the topic has unloaded events."""

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.defs.common import STOPPING_REASON, instance_stopping, runs_in_flight
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.devstats.freshness import unloaded_events
from pin_pipelines.errors import PinError


@dg.sensor(
    job=dim_layout_group_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a dim_layout_group load when the loader's consumer group lags.",
)
def dim_layout_group_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    try:
        lag = unloaded_events(Settings.from_env())
    except PinError as exc:
        return dg.SkipReason(f"consumer lag unreadable: {exc}")
    if not lag.events:
        return dg.SkipReason("dim_layout_group is up to date with the topic")
    if runs_in_flight(context, dim_layout_group_job.name):
        return dg.SkipReason("a load is already queued or running")
    return dg.RunRequest(tags={"pin/unloaded_events": str(lag.events)})
