"""Dagster storage at production cadence: `pin serve` on a fresh instance (its own
storage database and DAGSTER_HOME) under a fixed edit load, then what the instance grew by.
Prints ONE JSON line.

    .venv/bin/python bench/bench_dagster_storage.py [--minutes 5] [--projects 200] [--debounce 30]

Each project is edited about once a minute (the issue's load). Reported: runs per hour, event-log
rows and bytes per run, compute-log bytes per run (captured stdout/stderr under DAGSTER_HOME), and
the projected storage at steady state with the default retention (3 days of successful runs;
failures are rare here and kept 14 days): runs/day x bytes/run x 3 days, plus the sensor ticks
that the instance's own `retention:` keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BASE_DSN, bench_queries, fresh_database
from confluent_kafka import Consumer, TopicPartition

from pin_pipelines.config import DEFAULT_KAFKA_BOOTSTRAP as DEFAULT_KAFKA
from pin_pipelines.config import dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.devstats.offsets import DEFAULT_GROUP
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, client_config

SUCCESS_RETENTION_DAYS = 3


def skip_to_end(bootstrap: str) -> None:
    """Commit the loader's group at the end offsets of the layout-group topic."""
    consumer = Consumer({**client_config(bootstrap), "group.id": DEFAULT_GROUP})
    try:
        partitions = consumer.list_topics(TOPIC_LAYOUT_GROUP, timeout=10).topics
        offsets = [
            TopicPartition(
                TOPIC_LAYOUT_GROUP,
                p,
                consumer.get_watermark_offsets(TopicPartition(TOPIC_LAYOUT_GROUP, p), timeout=10)[
                    1
                ],
            )
            for p in partitions[TOPIC_LAYOUT_GROUP].partitions
        ]
        consumer.commit(offsets=offsets, asynchronous=False)
    finally:
        consumer.close()


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--projects", type=int, default=200)
    parser.add_argument("--debounce", type=int, default=30, help="seconds")
    parser.add_argument("--port", type=int, default=3118)
    args = parser.parse_args()

    dsn = fresh_database("pin_bench_dagster_storage")
    dagster_db = "pin_bench_dagster_storage_instance"
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dagster_db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dagster_db}"')
    with psycopg.connect(dsn, autocommit=True) as conn:
        projects = [
            r[0]
            for r in bench_queries("bench").insert_bench_projects(
                conn, projects=args.projects, buildings=2, layouts=10, objects=100
            )
        ]
        conn.execute(
            "UPDATE chessboard.recalc_settings SET debounce = make_interval(secs => %s)",
            (args.debounce,),
        )
        conn.execute("DELETE FROM chessboard.project_recalc_requests")
        conn.execute("TRUNCATE chessboard.outbox_events")

    home = Path(tempfile.mkdtemp(prefix="pin-bench-dagster-storage-"))
    env = {
        **os.environ,
        "PIN_PG_DSN": dsn,
        "DAGSTER_HOME": str(home),
        "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn, dagster_db),
        "PIN_DAGSTER_PORT": str(args.port),
        "PIN_CLICKHOUSE_URL": f"chdb://{home / 'chdb'}",  # a dimension of its own, migrated
    }
    subprocess.run(
        [sys.executable, "-m", "pin_pipelines.cli", "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
    )
    # The dimension loader's consumer group starts at the topic's end: a shared dev broker may
    # hold millions of older events, and loading them is not the load this measures.
    skip_to_end(env.get("PIN_KAFKA_BOOTSTRAP", DEFAULT_KAFKA))
    serve = subprocess.Popen(
        [sys.executable, "-m", "pin_pipelines.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    edits = 0
    try:
        time.sleep(15)  # daemon and code server start-up
        started = time.time()
        end = started + args.minutes * 60
        pause = 60.0 / args.projects  # each project about once a minute
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.time() < end:
                conn.execute(
                    "UPDATE chessboard.property_objects SET price = price + 1 WHERE id ="
                    " (SELECT id FROM chessboard.property_objects WHERE project_id = %s LIMIT 1)",
                    (random.choice(projects),),
                )
                edits += 1
                time.sleep(pause)
        elapsed = time.time() - started
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)

    instance_dsn = dsn_with_dbname(BASE_DSN, dagster_db)
    with psycopg.connect(instance_dsn) as conn:
        runs, events, event_bytes = conn.execute(
            "SELECT (SELECT count(*) FROM runs), count(*), coalesce(sum(length(event)), 0)"
            " FROM event_logs WHERE run_id IS NOT NULL AND run_id <> ''"
        ).fetchone() or (0, 0, 0)
        by_job = dict(
            conn.execute("SELECT pipeline_name, count(*) FROM runs GROUP BY 1").fetchall()
        )
        failed = conn.execute("SELECT count(*) FROM runs WHERE status = 'FAILURE'").fetchone()
        ticks, tick_bytes = conn.execute(
            "SELECT count(*), coalesce(sum(length(tick_body)), 0) FROM job_ticks"
        ).fetchone() or (0, 0)
        database_bytes = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    compute_log_bytes = _folder_bytes(home / "storage")
    runs_per_hour = runs / elapsed * 3600
    bytes_per_run = (event_bytes + compute_log_bytes) / runs if runs else 0
    ticks_per_day = ticks / elapsed * 86400
    # The instance keeps sensor ticks 1-7 days (dagster.yaml retention): count 3 days of them.
    steady_bytes = (
        runs_per_hour * 24 * SUCCESS_RETENTION_DAYS * bytes_per_run
        + ticks_per_day * 3 * (tick_bytes / ticks if ticks else 0)
    )
    print(
        json.dumps(
            {
                "bench": "dagster_storage",
                "minutes": round(elapsed / 60, 2),
                "projects": args.projects,
                "edits": edits,
                "debounce_s": args.debounce,
                "runs": runs,
                "runs_by_job": by_job,
                "failed_runs": failed[0] if failed else None,
                "runs_per_hour": round(runs_per_hour),
                "event_rows_per_run": round(events / runs, 1) if runs else None,
                "event_bytes_per_run": round(event_bytes / runs) if runs else None,
                "compute_log_bytes_per_run": round(compute_log_bytes / runs) if runs else None,
                "sensor_ticks_per_day": round(ticks_per_day),
                "instance_database_bytes_after_run": database_bytes[0] if database_bytes else None,
                "projected_steady_state_bytes": round(steady_bytes),
                "projected_steady_state_gb": round(steady_bytes / 1e9, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
