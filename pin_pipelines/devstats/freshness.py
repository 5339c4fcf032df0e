"""How far the dimension is behind its topic: the loader group's lag and the age of the oldest
event not loaded yet. That age is the spec's freshness (event → visible ≤ 5 minutes); the newest
UpsertedAt is not, since a quiet topic leaves it old while nothing is late."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from confluent_kafka import TopicPartition

from pin_pipelines.config import Settings
from pin_pipelines.devstats.offsets import (
    DEFAULT_GROUP,
    KAFKA_TIMEOUT,
    kafka_consumer,
    topic_partitions,
    unloaded_ranges,
)
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP

FRESHNESS_SLA_SECONDS = 300.0


@dataclass
class ConsumerLag:
    events: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)
    oldest_age_seconds: float | None = None


def unloaded_events(
    settings: Settings, *, topic: str = TOPIC_LAYOUT_GROUP, group: str = DEFAULT_GROUP
) -> ConsumerLag:
    """Reads the group's committed offsets and peeks at the first unloaded event of each lagging
    partition for its timestamp; commits nothing and never joins the group."""
    lag = ConsumerLag()
    with kafka_consumer(settings.kafka_bootstrap, group) as consumer:
        partitions = topic_partitions(consumer, topic)
        if not partitions:
            return lag
        behind: list[TopicPartition] = []
        for p, (start, high) in unloaded_ranges(consumer, topic, partitions).items():
            lag.per_partition[p] = high - start
            if high > start:
                behind.append(TopicPartition(topic, p, start))
        lag.events = sum(lag.per_partition.values())
        if behind:
            consumer.assign(behind)
            now_ms = time.time() * 1000
            oldest_ms: float | None = None
            deadline = time.monotonic() + KAFKA_TIMEOUT
            seen: set[int] = set()
            while len(seen) < len(behind) and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is None or msg.error() is not None or msg.partition() in seen:
                    continue
                seen.add(msg.partition() or 0)
                consumer.pause([TopicPartition(topic, msg.partition() or 0)])
                _, ts = msg.timestamp()
                oldest_ms = ts if oldest_ms is None else min(oldest_ms, ts)
            if oldest_ms is not None:
                lag.oldest_age_seconds = round(max(0.0, now_ms - oldest_ms) / 1000, 3)
    return lag
