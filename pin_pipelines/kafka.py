"""Kafka client settings shared by the relay, the loader and the stack (confluent-kafka)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from pin_pipelines.errors import PinError

TOPIC_PROJECT = "pin.chessboard.project-upserted.v1"
TOPIC_LAYOUT = "pin.chessboard.layout-upserted.v1"
TOPIC_LAYOUT_GROUP = "pin.chessboard.layout-group-upserted.v1"
TOPIC_DEVSTATS_DLQ = "pin.dev-stats.dlq.v1"
#: Internal to the outbox relay: one receipt per Kafka transaction (pin_pipelines/relay/outbox.py).
TOPIC_RELAY_COMMITS = "pin.chessboard.outbox-relay-commits.v1"
ALL_TOPICS = (
    TOPIC_PROJECT,
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    TOPIC_DEVSTATS_DLQ,
    TOPIC_RELAY_COMMITS,
)
TOPIC_PARTITIONS = 3
#: Topics made otherwise than TOPIC_PARTITIONS and the broker's defaults. The receipts: one
#: partition, so the last one is at its end; compacted, so the last one per key is kept forever,
#: and segments roll hourly so the compaction actually runs on a topic of small records.
TOPIC_LAYOUTS: dict[str, tuple[int, dict[str, str]]] = {
    TOPIC_RELAY_COMMITS: (1, {"cleanup.policy": "compact", "segment.ms": "3600000"}),
}


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


#: Answers of a broker that is up but still settling after a restart: electing partition leaders,
#: loading the group coordinators' offsets.
_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)

T = TypeVar("T")


def while_settling(call: Callable[[float], T], timeout: float = 10.0) -> T:
    """`call(seconds_left)`, retried until `timeout` while the broker answers with retriable or
    settling errors (for a few seconds after it restarted); any other error, or one that outlasts
    the timeout, is raised as it came. The call gets the time left, for its own timeout, so the
    whole stays within `timeout` (at least a second per attempt)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call(max(1.0, deadline - time.monotonic()))
        except KafkaException as exc:
            error = exc.args[0]
            settling = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _SETTLING
            )
            if not settling or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _list_topics(client: AdminClient, bootstrap: str, timeout: float = 10.0) -> list[str]:
    """Topic names; a broker still settling after a restart is waited for, not reported."""
    try:
        return while_settling(lambda left: list(client.list_topics(timeout=left).topics), timeout)
    except KafkaException as exc:
        raise PinError(f"Kafka at {bootstrap} is unreachable: {exc.args[0]}") from exc


def ensure_topics(bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS) -> list[str]:
    """Create missing topics (idempotent); returns the ones created."""
    client = admin(bootstrap)
    existing = set(_list_topics(client, bootstrap))
    missing = [t for t in topics if t not in existing]
    if not missing:
        return []
    layouts = {t: TOPIC_LAYOUTS.get(t, (TOPIC_PARTITIONS, {})) for t in missing}
    futures = client.create_topics(
        [
            NewTopic(t, num_partitions=partitions, replication_factor=1, config=config)
            for t, (partitions, config) in layouts.items()
        ],
        operation_timeout=10,
    )
    for topic, future in futures.items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise PinError(f"creating Kafka topic {topic} failed: {exc}") from exc
    return missing


def delete_topics(bootstrap: str, topics: tuple[str, ...]) -> None:
    """Delete topics that exist (tests and benchmarks remove the private topics they made:
    hundreds of left-over topics slow every metadata request of a long-lived dev broker)."""
    client = admin(bootstrap)
    present = set(_list_topics(client, bootstrap))
    existing = [t for t in topics if t in present]
    for topic, future in client.delete_topics(existing, operation_timeout=10).items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if "UNKNOWN_TOPIC_OR_PART" not in str(exc):
                raise PinError(f"deleting Kafka topic {topic} failed: {exc}") from exc
