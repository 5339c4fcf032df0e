"""Kafka client settings shared by the relay, the loader and the stack (confluent-kafka)."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from pin_pipelines.errors import PinError

TOPIC_PROJECT = "pin.chessboard.project-upserted.v1"
TOPIC_LAYOUT = "pin.chessboard.layout-upserted.v1"
TOPIC_LAYOUT_GROUP = "pin.chessboard.layout-group-upserted.v1"
TOPIC_DEVSTATS_DLQ = "pin.dev-stats.dlq.v1"
ALL_TOPICS = (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_DEVSTATS_DLQ)
TOPIC_PARTITIONS = 3


def _quiet(_err: Any) -> None:
    """librdkafka prints every refused connection to stderr; callers report failures themselves."""


def admin(bootstrap: str) -> AdminClient:
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "error_cb": _quiet, "log_level": 0}
    return AdminClient(config)


def broker_answers(bootstrap: str, timeout: float = 3.0) -> bool:
    try:
        admin(bootstrap).list_topics(timeout=timeout)
    except KafkaException:
        return False
    return True


#: Answers of a broker that is up but still electing leaders after a restart.
_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
    }
)


def _list_topics(client: AdminClient, bootstrap: str, timeout: float = 10.0) -> list[str]:
    """Topic names. A broker that just restarted answers with retriable errors (leader epochs
    still settling) for a few seconds: those are retried within the timeout, not reported."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return list(client.list_topics(timeout=max(1.0, deadline - time.monotonic())).topics)
        except KafkaException as exc:
            error = exc.args[0]
            retriable = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _SETTLING
            )
            if not retriable or time.monotonic() >= deadline:
                raise PinError(f"Kafka at {bootstrap} is unreachable: {error}") from exc
            time.sleep(0.5)


def ensure_topics(bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS) -> list[str]:
    """Create missing topics (idempotent); returns the ones created."""
    client = admin(bootstrap)
    existing = set(_list_topics(client, bootstrap))
    missing = [t for t in topics if t not in existing]
    if not missing:
        return []
    futures = client.create_topics(
        [NewTopic(t, num_partitions=TOPIC_PARTITIONS, replication_factor=1) for t in missing],
        operation_timeout=10,
    )
    for topic, future in futures.items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise PinError(f"creating Kafka topic {topic} failed: {exc}") from exc
    return missing
