"""What the relay published, as the contract's consumers read it (read_committed, from offsets
taken before the test, only the test's keys), and the relay job's run config in Dagster."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from pin_pipelines.relay import topic_end_offsets as end_offsets
from tests.support.contracts import assert_in_contract

Offsets = dict[str, dict[int, int]]


def consume(
    bootstrap: str,
    start: dict[str, dict[int, int]],
    keys: set[str],
    isolation: str = "read_committed",
) -> list[tuple[str, str, bytes]]:
    """(topic, key, value) of `keys` from `start` to the current end (see consume_messages)."""
    return [
        (str(m.topic()), bytes(m.key() or b"").decode(), bytes(m.value() or b""))
        for m in consume_messages(bootstrap, start, keys, isolation)
    ]


def consume_messages(
    bootstrap: str,
    start: dict[str, dict[int, int]],
    keys: set[str],
    isolation: str = "read_committed",
) -> list[Message]:
    """The messages of `keys` from `start` to the current end, in offset order per partition,
    as a consumer of this isolation level sees them. A partition is read when the consumer
    reports its end there: commit markers take offsets but are never handed out, and a
    read_committed consumer skips aborted transactions' messages, so offsets cannot tell."""
    end = end_offsets(bootstrap, list(start))
    remaining = {
        (t, p): end[t][p] for t, parts in start.items() for p, o in parts.items() if end[t][p] > o
    }
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-relay-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(t, p, start[t][p]) for t, p in remaining])
    found: list[Message] = []
    deadline = time.monotonic() + 30
    try:
        while remaining and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=1):
                tp = (str(msg.topic()), int(msg.partition() or 0))
                error = msg.error()
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    if int(msg.offset() or 0) >= remaining.get(tp, 0):
                        remaining.pop(tp, None)
                    continue
                if bytes(msg.key() or b"").decode() in keys:
                    assert_in_contract(tp[0], bytes(msg.value() or b""))
                    found.append(msg)
    finally:
        consumer.close()
    assert not remaining, f"did not reach the end offsets of {remaining}"
    return found


def assert_exactly_once_in_order(
    bootstrap: str, start: Offsets, events: dict[str, list[str]]
) -> list[tuple[str, str, bytes]]:
    """What a read_committed consumer of each topic sees: every event once, and per key the
    Version strictly increasing in offset order. Returns the messages."""
    messages = consume(bootstrap, start, set(events))
    seen = Counter(json.loads(value)["EventId"] for _, _, value in messages)
    expected = Counter(event_id for ids in events.values() for event_id in ids)
    assert seen == expected, (
        f"{sum(1 for e in expected if e not in seen)} events missing,"
        f" {sum(n - 1 for n in seen.values() if n > 1)} duplicates"
    )
    versions: dict[str, list[int]] = defaultdict(list)
    for _, key, value in messages:
        versions[key].append(json.loads(value)["Version"])
    broken = {k: v for k, v in versions.items() if v != sorted(set(v))}
    assert not broken, f"Version not strictly increasing for {len(broken)} keys: {broken}"
    return messages


def relay_config(budget: float = 2.0) -> dict[str, Any]:
    """A short run: the relay is continuous, the job ends at its budget."""
    return {"ops": {"relay_outbox": {"config": {"budget_seconds": budget}}}}
