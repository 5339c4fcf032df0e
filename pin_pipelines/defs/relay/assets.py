"""The three snapshot topics, as external assets: Dagster does not compute them, the relay
publishes to them and records a materialization per topic with counts and end offsets."""

import dagster as dg

from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT


def topic_asset_key(topic: str) -> dg.AssetKey:
    """`pin.chessboard.layout-upserted.v1` → kafka/layout_upserted_v1 (asset keys allow no dots)."""
    name = topic.removeprefix("pin.chessboard.").replace("-", "_").replace(".", "_")
    return dg.AssetKey(["kafka", name])


TOPIC_ASSETS = {
    topic: dg.AssetSpec(
        key=topic_asset_key(topic),
        description=(
            f"Kafka topic `{topic}`: snapshot events from the outbox (contract §4), written in"
            " Kafka transactions (read them read_committed)."
        ),
        deps=[CHESSBOARD_AGGREGATES],
        group_name="kafka",
        kinds={"kafka"},
        metadata={"topic": topic},
    )
    for topic in (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP)
}
