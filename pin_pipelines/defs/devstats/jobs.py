"""The load job the sensor launches, and the operator's backfill (replay from the beginning)."""

from uuid import UUID

import dagster as dg

from pin_pipelines.defs.devstats.assets import dim_layout_group, load_metadata
from pin_pipelines.defs.devstats.checks import dim_layout_group_fresh
from pin_pipelines.defs.pools import CLICKHOUSE_POOL
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.devstats.loading import IdRange, backfill
from pin_pipelines.errors import PinError
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
    #: Only these LayoutGroupIds are inserted, both included (either alone: no bound on the other
    #: side); the whole topic is read all the same. Text: Dagster config has no UUID type.
    from_id: str | None = None
    to_id: str | None = None


def _uuid(name: str, text: str | None) -> UUID | None:
    if text is None:
        return None
    try:
        return UUID(text)
    except ValueError:
        raise dg.Failure(f"{name} is not a UUID: {text!r}") from None


@dg.op(pool=CLICKHOUSE_POOL, tags={"kind": "clickhouse"})
def replay_layout_group_topic(
    context: dg.OpExecutionContext, config: BackfillConfig, pin: PinSettings
) -> None:
    if not config.confirm:
        raise dg.Failure("backfill replays the whole topic: set confirm: true to run it")
    try:
        ids = IdRange(_uuid("from_id", config.from_id), _uuid("to_id", config.to_id))
    except PinError as exc:  # an empty range
        raise dg.Failure(str(exc)) from None
    summary = backfill(pin.get(), ids=ids)
    metadata = {**load_metadata(summary), "skipped_out_of_range": summary.skipped_out_of_range}
    context.log_event(dg.AssetMaterialization(asset_key=dim_layout_group.key, metadata=metadata))
    if not summary.complete:  # bounded by LoadOptions.max_seconds: say it, the op still succeeds
        context.log.warning(
            f"backfill stopped at its time bound with {sum(summary.lag.values())} events left; "
            "the next dim_layout_group loads (dim_layout_group_sensor) continue the replay"
        )


@dg.job(
    tags=DEVSTATS_JOB_TAGS,
    description="Replay the layout-group topic from the beginning (config: confirm; from_id and "
    "to_id insert only that LayoutGroupId range).",
)
def dim_layout_group_backfill_job() -> None:
    replay_layout_group_topic()
