"""Commit → Kafka of the relay leg alone, taken apart: single outbox commits at random moments
(as the drain makes them, one project's events per transaction) while a continuous `pin outbox
relay` runs, each event's arrival seen by three consumers of its topic at once. Prints ONE JSON
line.

    .venv/bin/python bench/bench_commit_to_kafka.py [--commits 60] [--gap 0.2:1.5]

Per event, from its outbox row's creation (its Kafka timestamp; the commit follows within a
millisecond) to its arrival at:
- `uncommitted`: a read_uncommitted consumer (fetch.wait.max.ms 10): the relay produced it;
- `committed`: a read_committed consumer (fetch.wait.max.ms 10): its transaction committed;
- `committed_default`: a read_committed consumer with librdkafka's defaults (the 500 ms fetch
  long-poll), as a contract consumer reads;
plus `relay_pickup`: creation to the relay's receipt of the batch (its produce time).
Each consumer polls in a thread of its own that does nothing else, so an arrival is stamped when
librdkafka hands the message over. The database is a fresh one of its own (`pin_bench_c2k`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Arrivals, fresh_database, log, seconds_quantiles

from pin_pipelines.config import DEFAULT_KAFKA_BOOTSTRAP, RELAY_TRANSACTIONAL_ID_PREFIX
from pin_pipelines.kafka import (
    TOPIC_LAYOUT_GROUP,
    TOPIC_RELAY_COMMITS,
    client_config,
    ensure_topics,
)
from pin_pipelines.relay import topic_end_offsets

CONSUMERS = {
    "uncommitted": {"isolation.level": "read_uncommitted", "fetch.wait.max.ms": 10},
    "committed": {"isolation.level": "read_committed", "fetch.wait.max.ms": 10},
    "committed_default": {"isolation.level": "read_committed"},
}


def _payload(key: str) -> dict[str, Any]:
    return {
        "ContractVersion": 1, "EventId": str(uuid.uuid4()), "CreatedAt": "2025-01-31T10:20:30.123Z",
        "Id": key, "Version": 1, "ProjectId": str(uuid.uuid4()), "TenantId": str(uuid.uuid4()),
        "Name": "bench", "SortOrder": 1, "IsArchived": False, "LayoutsCount": 1, "AreaMin": 1.0,
        "AreaMax": 2.0,
    }  # fmt: skip


def _receipt_times(
    bootstrap: str, start: list[TopicPartition], key_prefix: bytes, until: float
) -> list[int]:
    """The Kafka timestamps (ms) of this relay's receipts: when it produced each batch."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-c2k-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign(start)
    stamps = []
    while time.time() < until:
        for msg in consumer.consume(1000, timeout=0.5):
            if msg.error() is None and (msg.key() or b"").startswith(key_prefix):
                stamps.append(msg.timestamp()[1])
    consumer.close()
    return sorted(stamps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument("--gap", default="0.2:1.5", help="seconds between commits: min:max")
    args = parser.parse_args()
    low, high = (float(x) for x in args.gap.split(":"))

    dsn = fresh_database("pin_bench_c2k")
    bootstrap = os.environ.get("PIN_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP)
    ensure_topics(bootstrap, (TOPIC_LAYOUT_GROUP, TOPIC_RELAY_COMMITS))
    ends = topic_end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP, TOPIC_RELAY_COMMITS])
    start = [TopicPartition(TOPIC_LAYOUT_GROUP, p, o) for p, o in ends[TOPIC_LAYOUT_GROUP].items()]
    receipts_start = [
        TopicPartition(TOPIC_RELAY_COMMITS, p, o) for p, o in ends[TOPIC_RELAY_COMMITS].items()
    ]
    consumers = {name: Arrivals(bootstrap, config, start) for name, config in CONSUMERS.items()}
    for consumer in consumers.values():
        consumer.start()
    relay = subprocess.Popen(
        [sys.executable, "-m", "pin_pipelines.cli", "outbox", "relay"],
        env={**os.environ, "PIN_PG_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    keys: list[str] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            warm = str(uuid.uuid4())  # the relay's start and its producer's: not measured
            conn.execute(
                "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
                " VALUES (%s, %s, %s)",
                (TOPIC_LAYOUT_GROUP, warm, Jsonb(_payload(warm))),
            )
            deadline = time.monotonic() + 60
            while warm not in consumers["committed"].seen and time.monotonic() < deadline:
                time.sleep(0.05)
            log("relay warm", seconds=round(60 - (deadline - time.monotonic()), 1))
            for _ in range(args.commits):
                time.sleep(random.uniform(low, high))
                key = str(uuid.uuid4())
                conn.execute(
                    "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
                    " VALUES (%s, %s, %s)",
                    (TOPIC_LAYOUT_GROUP, key, Jsonb(_payload(key))),
                )
                keys.append(key)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
            k not in c.seen for c in consumers.values() for k in keys
        ):
            time.sleep(0.1)
    finally:
        relay.send_signal(signal.SIGTERM)
        stdout, _ = relay.communicate(timeout=60)
        for consumer in consumers.values():
            consumer.stop.set()
        for consumer in consumers.values():
            consumer.join(10)
    receipts = _receipt_times(
        bootstrap,
        receipts_start,
        f"{RELAY_TRANSACTIONAL_ID_PREFIX}-pin_bench_c2k/".encode(),
        time.time() + 3,
    )
    legs: dict[str, list[float]] = {
        name: [(c.seen[k][1] * 1000 - c.seen[k][0]) / 1000 for k in keys if k in c.seen]
        for name, c in consumers.items()
    }
    # The first receipt at or after an event's creation is its batch's.
    created = sorted(
        consumers["committed"].seen[k][0] for k in keys if k in consumers["committed"].seen
    )
    legs["relay_pickup"] = [
        (next((r for r in receipts if r >= ms), ms) - ms) / 1000 for ms in created
    ]
    summary = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    print(
        json.dumps(
            {
                "bench": "commit_to_kafka",
                "commits": args.commits,
                "gap_s": args.gap,
                "lag": {name: seconds_quantiles(v, with_max=True) for name, v in legs.items()},
                "relay_runs": summary.get("runs"),
            }
        )
    )


if __name__ == "__main__":
    main()
