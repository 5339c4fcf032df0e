"""Keeps the dim_layout_group loader running: a run whenever none is in flight (lag or not: it must
be there when events come), its successor shortly before its budget ends (the hand-over, see
assets.py), and on a ClickHouse server extra loads for a backlog."""

from pin_pipelines.config import Settings
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.defs.sensors import Backlog, long_run_sensor
from pin_pipelines.devstats.loading import unloaded_events

#: Unloaded events above which another load joins the running one(s): about ten batches.
BACKLOG_EVENTS = 10_000


def _consumer_lag(settings: Settings) -> Backlog:
    """Loads are consumers of one group: each more splits the partitions (on a ClickHouse server;
    one on chdb, config.py) and costs a rebalance, so another one joins only for a backlog."""
    lag = unloaded_events(settings)
    return Backlog(
        tags={"pin/unloaded_events": str(lag.events)}, wants_more=lag.events >= BACKLOG_EVENTS
    )


dim_layout_group_sensor = long_run_sensor(
    name="dim_layout_group_sensor",
    job=dim_layout_group_job,
    op="dim_layout_group",
    noun="load",
    description=(
        "Keeps dim_layout_group loading: one long-lived load run, its successor near its end, "
        "and more for a backlog on a ClickHouse server (PIN_DEVSTATS_MAX_LOAD_RUNS)."
    ),
    read_backlog=_consumer_lag,
    # A load would only fail to join its group: launch none.
    unreadable="consumer lag unreadable",
    max_runs=lambda settings: settings.devstats_max_load_runs,
)
