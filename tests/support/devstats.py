"""Layout-group events for the loader tests: built, produced to a real topic, read back."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.kafka import client_config

BASE_TIME = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)


@dataclass
class Group:
    """One layout group of one developer; `event(version)` is its snapshot at that version."""

    developer_id: uuid.UUID = field(default_factory=uuid.uuid4)
    project_id: uuid.UUID = field(default_factory=uuid.uuid4)
    id: uuid.UUID = field(default_factory=uuid.uuid4)

    def event(self, version: int, **overrides: Any) -> dict[str, Any]:
        """CreatedAt grows with the version in whole seconds, so even the 18.16 server (DateTime,
        whole seconds) orders the versions of one group."""
        created = BASE_TIME + timedelta(seconds=version, milliseconds=123)
        return {
            "ContractVersion": 1,
            "EventId": str(uuid.uuid4()),
            "CreatedAt": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "Id": str(self.id),
            "Version": version,
            "ProjectId": str(self.project_id),
            "TenantId": str(self.developer_id),
            "Name": f"Студии v{version}",
            "SortOrder": version * 10,
            "IsArchived": False,
            "LayoutsCount": 3,
            "AreaMin": 21.5,
            "AreaMax": None,
            **overrides,
        }


def produce(
    bootstrap: str,
    topic: str,
    messages: Sequence[tuple[bytes | None, bytes | None]],
    partition: int | None = None,
) -> None:
    """Produce (key, value) pairs in order; with `partition`, all to that partition."""
    producer = Producer({**client_config(bootstrap), "enable.idempotence": True})
    for key, value in messages:
        if partition is None:
            producer.produce(topic, key=key, value=value)
        else:
            producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(15) == 0


def produce_events(bootstrap: str, topic: str, events: list[dict[str, Any]]) -> None:
    """Keyed by Id like the relay does, so one group's events share a partition, in order."""
    produce(bootstrap, topic, [(e["Id"].encode(), json.dumps(e).encode()) for e in events])


def open_transaction(bootstrap: str, topic: str, event: dict[str, Any]) -> Producer:
    """`event` produced in a Kafka transaction left open: a read_committed reader (the loader)
    stops short of it in its partition until the returned producer ends the transaction. Open
    for up to 15 minutes (the broker's default transaction.max.timeout.ms): at librdkafka's
    default of 60 s the coordinator aborted it itself under a slow CI run, fencing the producer,
    whose own abort then failed the test."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"test-open-{uuid.uuid4().hex}",
            "transaction.timeout.ms": 900_000,
        }
    )
    producer.init_transactions(15)
    producer.begin_transaction()
    producer.produce(topic, key=event["Id"].encode(), value=json.dumps(event).encode())
    assert producer.flush(15) == 0
    return producer


@dataclass(frozen=True)
class Received:
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]


def read_all(bootstrap: str, topic: str) -> list[Received]:
    """Every message of `topic` so far, in partition then offset order."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        pending, got = set(partitions), []
        for _ in range(200):
            if not pending:
                break
            msg = consumer.poll(0.1)
            if msg is None:
                continue
            err = msg.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                pending.discard(msg.partition())
            elif err is None:
                headers = _headers(msg)
                got.append(
                    ((msg.partition(), msg.offset()), Received(msg.key(), msg.value(), headers))
                )
        assert not pending, f"{topic}: partitions {pending} did not reach their end"
        return [received for _, received in sorted(got, key=lambda item: item[0])]
    finally:
        consumer.close()


def _headers(msg: Message) -> dict[str, str]:
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in pairs}


def committed(bootstrap: str, topic: str, group: str) -> dict[int, int]:
    """The group's committed offset per partition (-1001 where it has none)."""
    consumer = Consumer({**client_config(bootstrap), "group.id": group})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        consumer.close()


def physical_rows(ch: ClickHouse, group_id: uuid.UUID) -> list[tuple[int, str]]:
    """(SourceVersion, Name) of every stored row of a group, merged or not: what the table holds."""
    return sorted(
        (int(v), str(n))
        for v, n in ch.rows(
            "SELECT SourceVersion, Name FROM pin_dev_stats.dim_layout_group "
            "WHERE LayoutGroupId = %(id)s",
            {"id": group_id},
        )
    )
