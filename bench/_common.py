"""Shared set-up for benchmarks: a dedicated, migrated database, fast synthetic projects, and the
drain measured the way a worker runs it."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import aiosql
import psycopg
from confluent_kafka import Consumer, TopicPartition

from pin_pipelines.config import dsn_with_dbname
from pin_pipelines.kafka import client_config
from pin_pipelines.migrate import migrate_postgres
from pin_pipelines.recalc.drain import drain_tick

BASE_DSN = os.environ.get("PIN_PG_DSN", "postgresql://postgres@127.0.0.1:5432/pin")
#: The benchmarks' own SQL (fixtures, the plain baseline): next to them, not in the product's sql/.
BENCH_SQL = Path(__file__).resolve().parent / "sql"


@cache
def bench_queries(name: str) -> Any:
    """Named queries of bench/sql/<name>.sql (aiosql, psycopg driver), as the product's are."""
    return aiosql.from_path(BENCH_SQL / f"{name}.sql", "psycopg")


def log(message: str, **fields: Any) -> None:
    """A progress line on stderr: a JSON object with the time, the message and `fields`."""
    print(
        json.dumps({"t": datetime.now().strftime("%H:%M:%S"), "msg": message, **fields}),
        file=sys.stderr,
        flush=True,
    )


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fresh_database(name: str) -> str:
    """Drop and recreate `name` on the PIN_PG_DSN server, migrated; returns its DSN."""
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = dsn_with_dbname(BASE_DSN, name)
    migrate_postgres(dsn)
    return dsn


def quantiles(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(ordered),
        "p50_ms": round(pick(0.50) * 1000, 3),
        "p99_ms": round(pick(0.99) * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


def seconds_quantiles(values: list[float], *, with_max: bool = False) -> dict[str, Any] | None:
    """n, p50 and p99 (and the max) of `values` in seconds, 2 decimals; None without values."""
    if not values:
        return None
    q = quantiles(values)
    found = {
        "n": q["n"],
        "p50_s": round(q["p50_ms"] / 1000, 2),
        "p99_s": round(q["p99_ms"] / 1000, 2),
    }
    if with_max:
        found["max_s"] = round(max(values), 2)
    return found


class Arrivals(threading.Thread):
    """A consumer from the given offsets, in a thread that does nothing else: per key, the
    first message's Kafka timestamp (ms) and its arrival (epoch s), stamped when librdkafka
    hands it over (a consumer polled between other work stamps it when it is next polled)."""

    def __init__(self, bootstrap: str, config: dict[str, Any], start: list[TopicPartition]):
        super().__init__(daemon=True)
        self.consumer = Consumer(
            {
                **client_config(bootstrap),
                "group.id": f"bench-c2k-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                **config,
            }
        )
        self.consumer.assign(start)
        self.seen: dict[str, tuple[int, float]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.consumer.poll(0.05)
            if msg is not None and msg.error() is None:
                arrived = time.time()
                self.seen.setdefault(
                    bytes(msg.key() or b"").decode(), (msg.timestamp()[1], arrived)
                )
        self.consumer.close()


def drain_all(dsn: str) -> int:
    """Ticks (of the configured batch size) until one finds nothing due; returns the projects
    processed."""
    done = 0
    while True:
        tick = drain_tick(dsn)
        if not tick.results:
            return done
        done += len(tick.results)


def _drain_worker(dsn: str, result: multiprocessing.Queue[int]) -> None:
    result.put(drain_all(dsn))


def drain_throughput(dsn: str, workers: int) -> float:
    """Projects/s of `workers` processes (a process each, like drain runs) draining what is due
    until nothing is."""
    results: multiprocessing.Queue[int] = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=_drain_worker, args=(dsn, results)) for _ in range(workers)
    ]
    started = time.perf_counter()
    for p in procs:
        p.start()
    total = sum(results.get() for _ in procs)
    for p in procs:
        p.join()
    return total / (time.perf_counter() - started)
