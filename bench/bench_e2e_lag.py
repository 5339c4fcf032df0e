"""End-to-end lag: a committed change → the project's aggregates updated → its
event in Kafka → the dimension row, with `pin serve` (daemon, sensors, runs) running and the
spec's 30 s debounce. Prints ONE JSON line.

    .venv/bin/python bench/bench_e2e_lag.py [--changes 20] [--every 3]

Each change moves one layout's area, so its project's layout group gets new bounds: a
layout-group event the dimension loads. Legs, each p50/p99 in seconds:
- edit → recalc commit: the edit's commit to the group row's new `updated_at` (the drain);
- commit → Kafka: the event's outbox row creation (its Kafka timestamp, in the drain's
  transaction) to its arrival at a read_committed consumer with librdkafka's defaults, polled in
  a thread of its own (`commit_to_kafka_each`: every event's, in commit order);
- commit → Kafka as polled: the same to when this script's loop (which also queries PostgreSQL
  and ClickHouse, then sleeps 0.1 s) next polled its own consumer: what this leg reported before
  the thread (an arrival waits for the loop's next turn, so it adds up to a turn, `loop_turn`);
- Kafka → dimension: that arrival (the thread's) to the row's SourceVersion being visible to an
  argMax read;
- end to end: the edit's commit to the row being visible.
The dimension lives on the Debian ClickHouse server of `pin stack up --clickhouse-server` (a
database of its own), so this script can read it while the loader writes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BASE_DSN, Arrivals, bench_queries, fresh_database, seconds_quantiles

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import DEFAULT_KAFKA_BOOTSTRAP, dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.devstats.dim import stored_versions
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, client_config

CLICKHOUSE_URL = os.environ.get(
    "PIN_BENCH_CLICKHOUSE_URL", "clickhouse://default@127.0.0.1:9000/pin_dev_stats"
)


def _end_offsets(consumer: Consumer) -> list[TopicPartition]:
    topic = consumer.list_topics(TOPIC_LAYOUT_GROUP, timeout=10).topics[TOPIC_LAYOUT_GROUP]
    return [
        TopicPartition(
            TOPIC_LAYOUT_GROUP,
            p,
            consumer.get_watermark_offsets(TopicPartition(TOPIC_LAYOUT_GROUP, p), timeout=10)[1],
        )
        for p in topic.partitions
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between changes")
    parser.add_argument("--port", type=int, default=3117)
    parser.add_argument(
        "--database", default="pin_bench_e2e", help="made afresh, and <name>_dagster beside it"
    )
    args = parser.parse_args()

    dsn = fresh_database(args.database)
    dagster_db = f"{args.database}_dagster"
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dagster_db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dagster_db}"')
    bootstrap = os.environ.get("PIN_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP)
    home = tempfile.mkdtemp(prefix="pin-bench-dagster-")
    env = {
        **os.environ,
        "PIN_PG_DSN": dsn,
        "DAGSTER_HOME": home,
        "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn, dagster_db),
        "PIN_DAGSTER_PORT": str(args.port),
        "PIN_CLICKHOUSE_URL": CLICKHOUSE_URL,
    }
    subprocess.run(
        [sys.executable, "-m", "pin_pipelines.cli", "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        projects = [
            r[0]
            for r in bench_queries("bench").insert_bench_projects(
                conn, projects=args.changes, buildings=2, layouts=10, objects=200
            )
        ]
        # The initial load is not what we measure: settle it before the daemon starts.
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    for argv in (
        ["recalc", "drain", "--once", "--batch-size", "1000"],
        ["outbox", "relay", "--once"],
    ):
        subprocess.run(
            [sys.executable, "-m", "pin_pipelines.cli", *argv],
            env=env,
            check=True,
            capture_output=True,
        )
    # The loader's group starts at the topic's end: older events are not this run's load.
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-e2e-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    ends = _end_offsets(consumer)
    loader = Consumer({**client_config(bootstrap), "group.id": "pin-devstats-dim-layout-group"})
    loader.commit(offsets=ends, asynchronous=False)
    loader.close()
    consumer.assign(ends)
    arrivals = Arrivals(bootstrap, {"isolation.level": "read_committed"}, ends)
    arrivals.start()

    serve = subprocess.Popen(
        [sys.executable, "-m", "pin_pipelines.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    edited: dict[object, float] = {}  # layout group → its edit's commit (epoch seconds)
    recalc: dict[object, float] = {}
    kafka: dict[str, tuple[float, float]] = {}  # group → (CreatedAt, arrival)
    visible: dict[object, float] = {}
    turns: list[float] = []
    try:
        time.sleep(15)  # daemon and code server start-up
        random.shuffle(projects)
        with psycopg.connect(dsn, autocommit=True) as conn, open_clickhouse(CLICKHOUSE_URL) as ch:
            deadline = time.time() + args.changes * args.every + 150
            while time.time() < deadline and len(visible) < args.changes:
                turns.append(time.monotonic())
                if len(edited) < args.changes and (
                    not edited or time.time() - max(edited.values()) >= args.every
                ):
                    row = conn.execute(
                        "UPDATE chessboard.layouts SET total_area = total_area + 1 WHERE id ="
                        " (SELECT id FROM chessboard.layouts WHERE project_id = %s"
                        "  AND layout_group_id IS NOT NULL LIMIT 1)"
                        " RETURNING layout_group_id",
                        (projects[len(edited)],),
                    ).fetchone()
                    edited[row[0]] = time.time()
                for msg in consumer.consume(100, timeout=0.1):
                    if msg.error() is None:
                        arrived = time.time()
                        event = json.loads(msg.value() or b"{}")
                        created = datetime.fromisoformat(event["CreatedAt"].replace("Z", "+00:00"))
                        kafka.setdefault(event["Id"], (created.timestamp(), arrived))
                pending = [g for g in edited if g not in visible]
                if pending:
                    for group, updated in conn.execute(
                        "SELECT id, extract(epoch FROM updated_at) FROM chessboard.layout_groups"
                        " WHERE id = ANY(%s)",
                        (pending,),
                    ).fetchall():
                        if float(updated) > edited[group]:
                            recalc.setdefault(group, float(updated))
                    versions = stored_versions(ch, pending)  # the argMax read, by UUID int
                    expected = dict(
                        conn.execute(
                            "SELECT id, version FROM chessboard.layout_groups WHERE id = ANY(%s)",
                            ([g for g in pending if g in recalc],),
                        ).fetchall()
                    )
                    for group, version in expected.items():
                        if versions.get(group.int, -1) >= version:
                            visible[group] = time.time()
                time.sleep(0.1)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
        consumer.close()
        arrivals.stop.set()
        arrivals.join(10)
    precise = {
        g: arrivals.seen[str(g)] for g in sorted(recalc, key=recalc.get) if str(g) in arrivals.seen
    }
    legs = {
        "edit_to_recalc_commit": [recalc[g] - edited[g] for g in recalc],
        "commit_to_kafka": [arrived - ms / 1000 for ms, arrived in precise.values()],
        "commit_to_kafka_polled": [
            kafka[str(g)][1] - kafka[str(g)][0] for g in edited if str(g) in kafka
        ],
        "kafka_to_dimension": [visible[g] - precise[g][1] for g in visible if g in precise],
        "end_to_end": [visible[g] - edited[g] for g in visible],
    }
    print(
        json.dumps(
            {
                "bench": "e2e_lag",
                "debounce_s": 30,
                "changes": args.changes,
                # Edits made before the deadline (a loaded machine slows the loop below --every).
                "edited": len(edited),
                "observed": len(visible),
                "lag": {name: seconds_quantiles(values) for name, values in legs.items()},
                "commit_to_kafka_each": [round(v, 3) for v in legs["commit_to_kafka"]],
                "loop_turn": seconds_quantiles([b - a for a, b in itertools.pairwise(turns)]),
            }
        )
    )


if __name__ == "__main__":
    main()
