"""The load job the sensor launches, and the operator's backfill (replay from the beginning)."""

import dagster as dg

from pin_pipelines.defs.common import CLICKHOUSE_POOL
from pin_pipelines.defs.devstats.assets import dim_layout_group, load_metadata
from pin_pipelines.defs.devstats.checks import dim_layout_group_fresh
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.devstats.loader import backfill
from pin_pipelines.run_tags import DEVSTATS_JOB_TAGS

dim_layout_group_job = dg.define_asset_job(
    "dim_layout_group_job",
    # With its freshness check; the versions check compares every group and runs on its own.
    selection=dg.AssetSelection.assets(dim_layout_group).without_checks()
    | dg.AssetSelection.checks(dim_layout_group_fresh),
    tags=DEVSTATS_JOB_TAGS,
    description="Kafka → ClickHouse dim_layout_group, loading continuously for the run's budget.",
)


class BackfillConfig(dg.Config):
    #: A replay re-reads the whole topic; the guard makes it idempotent, but say it on purpose.
    confirm: bool = False


@dg.op(pool=CLICKHOUSE_POOL, tags={"kind": "clickhouse"})
def replay_layout_group_topic(
    context: dg.OpExecutionContext, config: BackfillConfig, pin: PinSettings
) -> None:
    if not config.confirm:
        raise dg.Failure("backfill replays the whole topic: set confirm: true to run it")
    summary = backfill(pin.get())
    context.log_event(
        dg.AssetMaterialization(asset_key=dim_layout_group.key, metadata=load_metadata(summary))
    )
    if not summary.complete:  # bounded by LoadOptions.max_seconds: say it, the op still succeeds
        context.log.warning(
            f"backfill stopped at its time bound with {sum(summary.lag.values())} events left; "
            "the next dim_layout_group loads (dim_layout_group_sensor) continue the replay"
        )


@dg.job(
    tags=DEVSTATS_JOB_TAGS,
    description="Replay the layout-group topic from the beginning (config: confirm).",
)
def dim_layout_group_backfill_job() -> None:
    replay_layout_group_topic()
