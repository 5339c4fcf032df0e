"""`dim_layout_group`: one materialization = one long-lived run of the continuous loader.

A run loads for `budget_seconds` (polls of 0.1 s, batches of ≤ 1000 events or 0.25 s), so an
event is in the dimension within about a second of reaching Kafka instead of a sensor tick and a
run launch later. The sensor launches the successor shortly before the budget ends:
it joins the loader's consumer group, and the eager rebalance commits the batch in hand before
any partition moves (no loss; no reordering, thanks to the version guard). On the embedded
engine the run owns the chdb folder and answers the readers' statements (and its successor's,
until the successor takes the folder over: clickhouse/owner.py), so nothing queues behind it.

A stop — the run canceled, `pin serve` stopping — stores and commits the batch in hand; the run
then records its summary (one materialization per run, never one per batch: the event log stays
small) and ends canceled or successful.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from pin_pipelines.config import DEFAULT_LONG_RUN_SECONDS
from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.stopping import stopped_by_signal
from pin_pipelines.devstats.loading import LoadOptions, LoadSummary, load_continuously
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP


class LoadConfig(dg.Config):
    #: How long one run loads before its successor takes over (the sensor launches it
    #: HANDOVER_SECONDS before this ends).
    budget_seconds: float = float(DEFAULT_LONG_RUN_SECONDS)


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
        # Produced → visible of the inserted events (0.0 when none: metadata has no null).
        "freshness_p50_seconds": summary.freshness_p50_seconds or 0.0,
        "freshness_p99_seconds": summary.freshness_p99_seconds or 0.0,
        "freshness_max_seconds": summary.freshness_max_seconds or 0.0,
    }


@dg.asset(
    name="dim_layout_group",
    key_prefix=[],
    deps=[TOPIC_ASSETS[TOPIC_LAYOUT_GROUP].key],
    group_name="dev_stats",
    kinds={"clickhouse"},
    description=(
        "pin_dev_stats.dim_layout_group (spec 003): ReplacingMergeTree(UpsertedAt) loaded from "
        "pin.chessboard.layout-group-upserted.v1 with the version guard; read with argMax. "
        "Each run loads continuously for its budget, then its successor takes over."
    ),
)
def dim_layout_group(
    context: dg.AssetExecutionContext, config: LoadConfig, pin: PinSettings
) -> Iterator[dg.MaterializeResult]:
    with stopped_by_signal(context) as stop:
        summary = load_continuously(
            pin.get(), LoadOptions(max_seconds=config.budget_seconds, should_stop=stop.requested)
        )
    yield dg.MaterializeResult(metadata=load_metadata(summary))
    stop.end()  # a canceled run ends canceled, with its summary
