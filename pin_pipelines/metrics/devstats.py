"""Metrics of the dim_layout_group loader (spec 003), read from its durable state in Kafka: the
loader group's committed offsets (consumed), the DLQ topic's end offsets (dead-lettered), and the
lag and freshness that `devstats.freshness` computes for the asset check too.

Freshness is the age of the oldest event not loaded yet: that age is where the 5-minute SLA is
broken, while the newest stored row would look old in a quiet week for no fault of the loader.
Inserted and skipped-stale counts are not in Kafka; the loader records them (`devstats.counters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pin_pipelines.config import Settings
from pin_pipelines.devstats.loading import (
    DEFAULT_GROUP,
    committed_offsets,
    kafka_consumer,
    topic_partitions,
    unloaded_events,
    watermarks,
)
from pin_pipelines.kafka import TOPIC_DEVSTATS_DLQ, TOPIC_LAYOUT_GROUP


@dataclass(frozen=True)
class LoaderKafkaState:
    #: partition → the loader group's committed offset (0 before its first commit): consumed.
    consumed: dict[int, int] = field(default_factory=dict)
    #: partition → events after the committed offset.
    lag: dict[int, int] = field(default_factory=dict)
    #: Messages in the DLQ topic: the loader is its only writer.
    dead_lettered: int = 0
    #: Age of the oldest event not loaded yet, 0 when every partition is caught up.
    freshness_lag_seconds: float = 0.0


def read_kafka_state(
    settings: Settings,
    *,
    topic: str = TOPIC_LAYOUT_GROUP,
    group: str = DEFAULT_GROUP,
    dlq_topic: str = TOPIC_DEVSTATS_DLQ,
) -> LoaderKafkaState:
    """Reads as the loader's group without joining it or committing: the loader is undisturbed."""
    behind = unloaded_events(settings, topic=topic, group=group)
    with kafka_consumer(settings.kafka_bootstrap, group) as consumer:
        committed = committed_offsets(consumer, topic, topic_partitions(consumer, topic))
        dead = sum(
            watermarks(consumer, dlq_topic, p)[1] for p in topic_partitions(consumer, dlq_topic)
        )
    return LoaderKafkaState(
        consumed={tp.partition: max(tp.offset, 0) for tp in committed},
        lag=dict(behind.per_partition),
        dead_lettered=dead,
        freshness_lag_seconds=behind.oldest_age_seconds or 0.0,
    )


def families(s: LoaderKafkaState | None) -> list[Metric]:
    """Families of `s`; without a state, the same families without samples (describe)."""
    consumed = CounterMetricFamily(
        "devstats_loader_consumed",
        "Layout-group events the loader consumed and committed, by partition.",
        labels=["partition"],
    )
    lag = GaugeMetricFamily(
        "devstats_loader_lag_messages",
        "Layout-group events not yet loaded, by partition.",
        labels=["partition"],
    )
    dead = CounterMetricFamily(
        "devstats_loader_dead_lettered", "Unreadable events the loader wrote to the DLQ topic."
    )
    fresh = GaugeMetricFamily(
        "devstats_dim_layout_group_freshness_lag_seconds",
        "Age of the oldest layout-group event not yet in dim_layout_group (0 when caught up)."
        " Spec 003 SLA: <= 300 s.",
    )
    if s is not None:
        for p in sorted(s.consumed.keys() | s.lag.keys()):
            consumed.add_metric([str(p)], s.consumed.get(p, 0))
            lag.add_metric([str(p)], s.lag.get(p, 0))
        dead.add_metric([], s.dead_lettered)
        fresh.add_metric([], s.freshness_lag_seconds)
    return [consumed, lag, dead, fresh]
