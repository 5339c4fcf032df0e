"""Outbox relay benchmark; not a test. Prints ONE JSON line.

1. Throughput: a backlog of N layout-group events is relayed by `relay_once` (exactly once: a
   Kafka transaction per batch, receipts, recovery at start); the same payloads are then sent from
   memory by a plain confluent-kafka producer with the same per-message guarantees (idempotent,
   acks=all). Ratio = relay / plain (goal >= 0.5). `ratio_same_config` compares with the relay's
   own producer settings without transactions, sent from memory: the cost of the outbox and of
   exactly-once together. `ratio_transactional` compares with that producer in transactions of
   the relay's batch size, from memory: the cost of the outbox alone.
2. Lag: the drain's insert pattern at a steady rate (default 1,000 events/s, 100 per commit) for
   a few seconds while a continuous relay (`OutboxRelay.run_until`, its own process) publishes;
   a read_committed consumer (what the contract's consumers are) measures arrival time -
   CreatedAt per event. Goal: p99 < 2 s.

Usage: .venv/bin/python bench/bench_relay.py [--events 200000] [--rate 1000] [--seconds 20]
Uses PIN_PG_DSN / PIN_KAFKA_BOOTSTRAP / PIN_RELAY_TRANSACTIONAL_ID and TRUNCATEs
chessboard.outbox_events.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from pin_pipelines.config import Settings
from pin_pipelines.db import connect
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, client_config, ensure_topics
from pin_pipelines.migrate import migrate_postgres
from pin_pipelines.relay import OutboxRelay, relay_once, topic_end_offsets
from pin_pipelines.relay.outbox import DELIVERY_TIMEOUT, MAX_BATCH_SIZE
from pin_pipelines.relay.producer import Sender, producer_config

# The drain's shape: one statement inserting a burst of layout-group snapshots, `keys` entities.
INSERT_EVENTS = """
INSERT INTO chessboard.outbox_events (topic, message_key, payload)
SELECT %(topic)s, k.id::text, jsonb_build_object(
    'ContractVersion', 1, 'EventId', gen_random_uuid(),
    'CreatedAt', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
    'Id', k.id, 'Version', %(version)s + g / %(keys)s, 'ProjectId', %(project)s::uuid,
    'TenantId', %(tenant)s::uuid, 'Name', 'Секция ' || g, 'SortOrder', g %% 50,
    'IsArchived', false, 'LayoutsCount', g %% 40, 'AreaMin', 31.5, 'AreaMax', 118.25)
FROM generate_series(0, %(count)s - 1) g
JOIN LATERAL (SELECT (%(ids)s::uuid[])[1 + g %% %(keys)s] AS id) k ON true
"""


def insert_events(conn, count: int, keys: list[str], version: int = 1) -> None:
    conn.execute(
        INSERT_EVENTS,
        {
            "topic": TOPIC_LAYOUT_GROUP,
            "ids": keys,
            "keys": len(keys),
            "count": count,
            "version": version,
            "project": str(uuid.uuid4()),
            "tenant": str(uuid.uuid4()),
        },
    )


def throughput(settings: Settings, events: int) -> dict[str, float]:
    with connect(settings.pg_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE chessboard.outbox_events")
        insert_events(conn, events, [str(uuid.uuid4()) for _ in range(events // 10)])
        messages = conn.execute(
            "SELECT message_key, payload::text FROM chessboard.outbox_events ORDER BY id"
        ).fetchall()
        conn.execute("VACUUM ANALYZE chessboard.outbox_events")

    started = time.perf_counter()
    summary = relay_once(settings)
    relay_seconds = time.perf_counter() - started
    assert summary.published == events, summary.as_dict()

    # The baseline: a plain producer, librdkafka defaults plus the relay's guarantees.
    plain_seconds = _send_from_memory(
        Producer(
            {
                **client_config(settings.kafka_bootstrap),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
            }
        ),
        messages,
    )
    # The relay's own producer settings (lz4, 20 ms linger), also from memory: what is left of
    # the ratio is the outbox and exactly-once (reading, transactions, bookkeeping, deleting).
    same_config_seconds = _send_from_memory(
        Producer(producer_config(settings.kafka_bootstrap, DELIVERY_TIMEOUT)), messages
    )
    # The same in transactions of the relay's batch size: what is left is the outbox alone.
    transactional_seconds = _send_in_transactions(
        Sender(settings.kafka_bootstrap, f"bench-relay-{uuid.uuid4()}", DELIVERY_TIMEOUT),
        messages,
    )
    relay_rate, plain_rate = events / relay_seconds, events / plain_seconds
    same_config_rate = events / same_config_seconds
    transactional_rate = events / transactional_seconds
    return {
        "throughput_events": events,
        "relay_events_per_s": round(relay_rate),
        "plain_producer_events_per_s": round(plain_rate),
        "ratio": round(relay_rate / plain_rate, 3),
        "same_config_producer_events_per_s": round(same_config_rate),
        "ratio_same_config": round(relay_rate / same_config_rate, 3),
        "transactional_producer_events_per_s": round(transactional_rate),
        "ratio_transactional": round(relay_rate / transactional_rate, 3),
    }


def _send_from_memory(producer: Producer, messages: list[tuple[str, str]]) -> float:
    started = time.perf_counter()
    for key, value in messages:
        while True:
            try:
                producer.produce(TOPIC_LAYOUT_GROUP, value.encode(), key)
                break
            except BufferError:
                producer.poll(0.01)
    assert producer.flush(60) == 0
    return time.perf_counter() - started


def _send_in_transactions(sender: Sender, messages: list[tuple[str, str]]) -> float:
    started = time.perf_counter()
    for first in range(0, len(messages), MAX_BATCH_SIZE):
        sender.begin()
        for key, value in messages[first : first + MAX_BATCH_SIZE]:
            sender.send(TOPIC_LAYOUT_GROUP, key, value.encode())
        assert sender.wait() == []
        sender.commit()
    return time.perf_counter() - started


def _relay_worker(stop: Any) -> None:
    """A continuous relay in its own process (multiprocessing Event `stop` ends it)."""
    thread_stop = threading.Event()

    def relay_stop() -> None:
        stop.wait()
        thread_stop.set()

    threading.Thread(target=relay_stop, daemon=True).start()
    with OutboxRelay(Settings.from_env()) as relay:
        relay.run_until(thread_stop.is_set)


def lag(settings: Settings, rate: int, seconds: float) -> dict[str, float]:
    per_commit = max(rate // 10, 1)
    with connect(settings.pg_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE chessboard.outbox_events")
    start_offsets = topic_end_offsets(settings.kafka_bootstrap, [TOPIC_LAYOUT_GROUP])
    consumer = Consumer(
        {
            **client_config(settings.kafka_bootstrap),
            "group.id": f"bench-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign(
        [
            TopicPartition(TOPIC_LAYOUT_GROUP, p, o)
            for p, o in start_offsets[TOPIC_LAYOUT_GROUP].items()
        ]
    )
    lags: list[float] = []
    stop_consumer = threading.Event()

    def consume() -> None:
        while not stop_consumer.is_set():
            for msg in consumer.consume(1000, timeout=0.05):
                if msg.error() is None:
                    created = json.loads(msg.value() or b"{}")["CreatedAt"]
                    created_at = datetime.fromisoformat(created.replace("Z", "+00:00"))
                    lags.append(datetime.now(UTC).timestamp() - created_at.timestamp())

    stop = multiprocessing.get_context("spawn").Event()
    worker = multiprocessing.get_context("spawn").Process(target=_relay_worker, args=(stop,))
    worker.start()
    reader = threading.Thread(target=consume)
    reader.start()
    keys = [str(uuid.uuid4()) for _ in range(2000)]
    inserted, ticks = 0, int(seconds * 10)
    with connect(settings.pg_dsn, autocommit=True) as conn:
        # The worker makes its producer (init_transactions, recovery) at its first event: one
        # event through before the load, so the figure is the steady state's.
        insert_events(conn, 1, [str(uuid.uuid4())])
        deadline = time.monotonic() + 60
        while not lags and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lags, "the warm-up event never arrived"
        lags.clear()
        begin = time.monotonic()
        for tick in range(ticks):
            insert_events(conn, per_commit, keys, version=tick + 1)
            inserted += per_commit
            time.sleep(max(begin + (tick + 1) / 10 - time.monotonic(), 0))
        load_seconds = time.monotonic() - begin
    deadline = time.monotonic() + 30
    while len(lags) < inserted and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    worker.join(30)
    stop_consumer.set()
    reader.join()
    consumer.close()
    lags.sort()
    return {
        "lag_events_inserted": inserted,
        "lag_events_received": len(lags),
        "lag_insert_rate_per_s": round(inserted / load_seconds),
        "lag_p50_s": round(lags[len(lags) // 2], 3),
        "lag_p99_s": round(lags[int(len(lags) * 0.99) - 1], 3),
        "lag_max_s": round(lags[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    settings = Settings.from_env()
    migrate_postgres(settings.pg_dsn)
    ensure_topics(settings.kafka_bootstrap, (TOPIC_LAYOUT_GROUP,))
    result = throughput(settings, args.events) | lag(settings, args.rate, args.seconds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
