"""Layout-group events for the loader tests: built, produced to a real topic, read back; a
topic's end offsets and a group moved there; the loader's consumer group as Kafka sees it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import (
    Consumer,
    ConsumerGroupState,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.devstats.offsets import (
    DEFAULT_GROUP,
    commit_offsets,
    committed_offsets,
    kafka_consumer,
)
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, admin, client_config
from pin_pipelines.relay import topic_end_offsets
from tests.support.contracts import assert_in_contract

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
    """Keyed by Id like the relay does, so one group's events share a partition, in order. They
    are good events: each keeps the topic's contract (a bad one is produced with `produce`)."""
    for event in events:
        assert_in_contract(TOPIC_LAYOUT_GROUP, event)
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


# --- offsets ----------------------------------------------------------------------------------


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}"})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        return {
            p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
            for p in partitions
        }
    finally:
        consumer.close()


def commit_group(bootstrap: str, topic: str, group: str, offsets: dict[int, int]) -> None:
    """Move `group` to `offsets` the way the loader commits (explicit offsets, no membership)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        done = consumer.commit(
            offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False
        )
        assert all(tp.error is None for tp in done or []), done
    finally:
        consumer.close()


# --- the loader's group on the contract topic -------------------------------------------------


def group_offsets(bootstrap: str) -> dict[int, int]:
    """The loader group's committed offsets (a coordinator being moved is waited for)."""
    with kafka_consumer(bootstrap, DEFAULT_GROUP) as reader:
        found = committed_offsets(reader, TOPIC_LAYOUT_GROUP, range(6))
    return {tp.partition: tp.offset for tp in found}


def group_at_end(bootstrap: str) -> dict[int, int]:
    """Commit the topic's end offsets for the loader group (empty between tests): what other tests
    of the module published is not this test's. Returns them."""
    ends = topic_end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
    with kafka_consumer(bootstrap, DEFAULT_GROUP) as committer:
        commit_offsets(
            committer, [TopicPartition(TOPIC_LAYOUT_GROUP, p, o) for p, o in ends.items()]
        )
    return ends


def describe_group(bootstrap: str) -> Any:
    """The loader group as its coordinator sees it (the client is kept until the answer: a
    collected AdminClient fails its futures)."""
    client = admin(bootstrap)
    [future] = client.describe_consumer_groups([DEFAULT_GROUP]).values()
    return future.result(timeout=15)


def coordinator(bootstrap: str) -> int:
    """The node coordinating the loader group (it also leads partitions of the topic)."""
    return int(describe_group(bootstrap).coordinator.id)


def group_state(bootstrap: str) -> ConsumerGroupState:
    state: ConsumerGroupState = describe_group(bootstrap).state
    return state


def shares(bootstrap: str) -> list[set[int]]:
    """The topic's partitions each member of the loader group holds (none while rebalancing)."""
    return [
        {tp.partition for tp in member.assignment.topic_partitions}
        for member in describe_group(bootstrap).members
    ]
