"""`dim_layout_group`: one materialization = one bounded consume-and-load cycle."""

from typing import Any

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.defs.common import instance_stopping
from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.devstats.loader import LoadOptions, LoadSummary, load_once
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP

#: The embedded engine admits one process per data folder; dagster.yaml limits every pool to one
#: op at a time, so two runs never open it at once.
CLICKHOUSE_POOL = "clickhouse"


def _load_pool() -> str | None:
    """On chdb the load holds the folder's one process (the pool); on a server, loads run side by
    side as consumers of one group, PIN_DEVSTATS_MAX_LOAD_RUNS at most (the run queue's limit)."""
    return CLICKHOUSE_POOL if Settings.from_env().clickhouse_url.startswith("chdb://") else None


def load_metadata(summary: LoadSummary) -> dict[str, Any]:
    return {
        "consumed": summary.consumed,
        "inserted": summary.inserted,
        "skipped_stale": summary.skipped_stale,
        "dead_lettered": summary.dead_lettered,
        "batches": summary.batches,
        "complete": summary.complete,
        "consumer_lag": dg.MetadataValue.json({str(p): n for p, n in sorted(summary.lag.items())}),
        "seconds": round(summary.seconds, 3),
    }


@dg.asset(
    name="dim_layout_group",
    key_prefix=[],
    deps=[TOPIC_ASSETS[TOPIC_LAYOUT_GROUP].key],
    group_name="dev_stats",
    kinds={"clickhouse"},
    pool=_load_pool(),
    description=(
        "pin_dev_stats.dim_layout_group (spec 003): ReplacingMergeTree(UpsertedAt) loaded from "
        "pin.chessboard.layout-group-upserted.v1 with the version guard; read with argMax."
    ),
)
def dim_layout_group(context: dg.AssetExecutionContext, pin: PinSettings) -> dg.MaterializeResult:
    options = LoadOptions(should_stop=lambda: instance_stopping(context.instance))
    return dg.MaterializeResult(metadata=load_metadata(load_once(pin.get(), options)))
