"""dim_layout_group loader benchmark; not a test. Prints ONE JSON line.

For each ClickHouse path (the embedded engine in a fresh temporary folder, and the server):

1. Ingest rate: N layout-group events (G groups updated round-robin, versions in order per key,
   as the relay publishes them) are produced to a topic of this run, then ONE `load_once` consumes
   them into `pin_dev_stats.dim_layout_group`: JSON parsing, in-batch reduction, the version guard
   query, the insert, the DLQ path and the offset commits, end to end (wall time of the call).
   The baseline inserts the very rows the loader inserted, batch for batch (the loader's batches
   are recorded), through the same client's `ch.insert`, into a copy of the table (same engine and
   settings, holding the same rows as the loader's at its start). Each phase starts once the
   engine has no merge running, so neither pays for the other's background merges. Rates are
   events/s: N / wall time of each.
   Ratio = loader / plain (goal >= 0.5); embedded goal >= 20,000 events/s. The machine is shared
   and the server's background work varies, so each path runs T trials (fresh topic and groups
   each) and reports its median trial, with every trial's ratio in `trial_ratios`.
2. Freshness: a producer thread publishes a steady R events/s (CreatedAt = now) for S seconds while
   the main thread calls `load_once` back to back (what the sensor does, minus its 5-second tick
   and the run launch) and, after each cycle, polls the pending events with an argMax read; the
   latency of an event is the time of the first poll that saw its version (or a newer one) minus
   its CreatedAt. Polling after each cycle can only overstate the latency. Goal: p99 < 10 s.

Usage: .venv/bin/python bench/bench_devstats.py [--events 100000] [--groups 10000]
       [--rate 1000] [--seconds 20] [--paths chdb,server] [--trials 5]
Uses PIN_KAFKA_BOOTSTRAP, PIN_PG_DSN's server for a fresh `pin_bench_devstats` database (the
loader's counters) and PIN_BENCH_CLICKHOUSE_SERVER_URL (default: a Debian clickhouse-server of
this run alone, on a free port, in a temporary folder; the package must be installed).
Topics and consumer groups are unique per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fresh_database

from pin_pipelines.clickhouse import ClickHouse, ServerAddress, migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.literals import UuidSet
from pin_pipelines.config import Settings
from pin_pipelines.devstats import inserts
from pin_pipelines.devstats.dim import TABLE
from pin_pipelines.devstats.events import COLUMNS
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.kafka import client_config, delete_topics, ensure_topics
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import free_port

VISIBLE = f"""
SELECT LayoutGroupId, argMax(SourceVersion, UpsertedAt)
FROM {TABLE}
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId
"""


class Groups:
    """G layout groups of a few developers; `event(i)` is the i-th event of a round-robin stream."""

    def __init__(self, count: int) -> None:
        developers = [str(uuid.uuid4()) for _ in range(max(1, count // 100))]
        self.ids = [str(uuid.uuid4()) for _ in range(count)]
        self.parents = [(str(uuid.uuid4()), developers[i % len(developers)]) for i in range(count)]

    def event(self, i: int, created: datetime) -> tuple[bytes, bytes]:
        g = i % len(self.ids)
        project, developer = self.parents[g]
        payload = {
            "ContractVersion": 1,
            "EventId": str(uuid.uuid4()),
            "CreatedAt": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "Id": self.ids[g],
            "Version": i // len(self.ids) + 1,
            "ProjectId": project,
            "TenantId": developer,
            "Name": f"Студии {i}",
            "SortOrder": g % 50,
            "IsArchived": False,
            "LayoutsCount": 4,
            "AreaMin": 21.5,
            "AreaMax": None,
        }
        return self.ids[g].encode(), json.dumps(payload).encode()


def new_producer(bootstrap: str) -> Producer:
    return Producer(
        {
            **client_config(bootstrap),
            "enable.idempotence": True,
            "linger.ms": 5,
            "log_level": 0,
        }
    )


def produce(producer: Producer, topic: str, key: bytes, value: bytes) -> None:
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:
            producer.poll(0.01)


@contextmanager
def fresh_options(kind: str, bootstrap: str) -> Iterator[LoadOptions]:
    """Topics and a consumer group of this measurement only; the topics are deleted after it."""
    suffix = f"{kind}.{uuid.uuid4().hex[:10]}"
    options = LoadOptions(
        topic=f"pin.bench.layout-group-upserted.{suffix}",
        dlq_topic=f"pin.bench.dlq.{suffix}",
        group=f"pin-bench-devstats-{suffix}",
    )
    ensure_topics(bootstrap, (options.topic, options.dlq_topic))
    try:
        yield options
    finally:
        delete_topics(bootstrap, (options.topic, options.dlq_topic))


def settle(ch: ClickHouse, timeout: float = 60.0) -> None:
    """Wait until the engine merges nothing, then write back the dirty page cache: neither the
    merges of one phase's 100 inserts nor the kernel's writeback of what it (or the producer)
    wrote may run during, and slow down, the next phase."""
    deadline = time.monotonic() + timeout
    while ch.rows("SELECT count() FROM system.merges")[0][0] and time.monotonic() < deadline:
        time.sleep(0.2)
    os.sync()


def merged_rows(ch: ClickHouse) -> int:
    found = ch.rows("SELECT value FROM system.events WHERE event = 'MergedRows'")
    return int(found[0][0]) if found else 0


@contextmanager
def server_url(folder: Path) -> Iterator[str]:
    """PIN_BENCH_CLICKHOUSE_SERVER_URL, else a Debian server of this run alone (a free port, a
    state folder under `folder`): the run's synthetic groups never land in the dev dimension, and
    no earlier run's parts are still being cleaned up while this one measures."""
    if url := os.environ.get("PIN_BENCH_CLICKHOUSE_SERVER_URL"):
        yield url
        return
    server = LocalClickHouseServer(ServerAddress("127.0.0.1", free_port(), "default", ""), folder)
    server.up()
    try:
        yield f"clickhouse://default@127.0.0.1:{server.address.port}/pin_dev_stats"
    finally:
        server.down()


@contextmanager
def recorded_batches() -> Iterator[list[list[Any]]]:
    """The events of every insert the loader makes, batch for batch (one list append per batch;
    their rows are built after the timing)."""
    batches: list[list[Any]] = []
    real = inserts.insert_events

    def recording(ch: ClickHouse, events: Any) -> int:
        events = list(events)
        batches.append(events)
        return real(ch, events)

    inserts.insert_events = recording  # type: ignore[assignment]
    try:
        yield batches
    finally:
        inserts.insert_events = real  # type: ignore[assignment]


def ingest(ch: ClickHouse, settings: Settings, kind: str, events: int, groups: int) -> dict:
    with fresh_options(kind, settings.kafka_bootstrap) as options:
        stream = Groups(groups)
        producer = new_producer(settings.kafka_bootstrap)
        now = datetime.now(UTC)
        for i in range(events):
            produce(producer, options.topic, *stream.event(i, now))
        assert producer.flush(60) == 0

        # The baseline's table: same engine and settings, holding the same rows as the
        # dimension at the loader's start (earlier trials' groups), so both phases' inserts meet
        # the same parts to merge with.
        plain = f"{TABLE}_plain_{uuid.uuid4().hex[:8]}"
        ch.command(f"CREATE TABLE {plain} AS {TABLE}")
        try:
            ch.command(f"INSERT INTO {plain} SELECT * FROM {TABLE}")
            settle(ch)
            with recorded_batches() as batches:
                merged_before = merged_rows(ch)
                started = time.perf_counter()
                summary = load_once(settings, options)
                loader_seconds = time.perf_counter() - started
                loader_merged = merged_rows(ch) - merged_before
            assert summary.complete and summary.consumed == events, summary.as_dict()
            assert sum(map(len, batches)) == summary.inserted
            rows = [[event.row() for event in batch] for batch in batches]

            settle(ch)
            merged_before = merged_rows(ch)
            started = time.perf_counter()
            for batch_rows in rows:
                ch.insert(plain, COLUMNS, batch_rows)
            plain_seconds = time.perf_counter() - started
            plain_merged = merged_rows(ch) - merged_before
        finally:
            ch.command(f"DROP TABLE IF EXISTS {plain}")

        loader_rate, plain_rate = events / loader_seconds, events / plain_seconds
        return {
            "events": events,
            "groups": groups,
            "rows_inserted": summary.inserted,
            "skipped_stale": summary.skipped_stale,
            "batches": summary.batches,
            "loader_seconds": round(loader_seconds, 3),
            "plain_insert_seconds": round(plain_seconds, 3),
            "loader_events_per_s": round(loader_rate),
            "plain_insert_events_per_s": round(plain_rate),
            "ratio": round(loader_rate / plain_rate, 3),
            # Rows the engine's background merges processed while each phase ran: the 2 cores
            # they take are what makes single trials differ most.
            "loader_phase_merged_rows": loader_merged,
            "plain_phase_merged_rows": plain_merged,
        }


def freshness(
    ch: ClickHouse, settings: Settings, kind: str, rate: int, seconds: float, groups: int
) -> dict:
    with fresh_options(kind, settings.kafka_bootstrap) as options:
        stream = Groups(groups)
        produced: dict[tuple[str, int], float] = {}  # (group id, version) → CreatedAt (epoch s)
        lock = threading.Lock()
        done = threading.Event()

        def publish() -> None:
            producer = new_producer(settings.kafka_bootstrap)
            per_tick, tick = max(1, rate // 100), 0.01
            begin, i = time.monotonic(), 0
            while time.monotonic() - begin < seconds:
                for _ in range(per_tick):
                    created = datetime.now(UTC)
                    key, value = stream.event(i, created)
                    with lock:
                        produced[(key.decode(), i // groups + 1)] = created.timestamp()
                    produce(producer, options.topic, key, value)
                    i += 1
                producer.poll(0)
                time.sleep(max(0.0, begin + (i // per_tick) * tick - time.monotonic()))
            producer.flush(30)
            done.set()

        publisher = threading.Thread(target=publish)
        publisher.start()
        latencies: list[float] = []
        cycles, cycle_seconds = 0, 0.0
        deadline = time.monotonic() + seconds + 60
        while time.monotonic() < deadline:
            started = time.monotonic()
            load_once(settings, options)
            cycles += 1
            cycle_seconds += time.monotonic() - started
            with lock:
                pending = dict(produced)
            if pending:
                ids = sorted({gid for gid, _ in pending})
                found = ch.rows(VISIBLE, {"ids": UuidSet([uuid.UUID(gid) for gid in ids])})
                seen = {str(gid): int(version) for gid, version in found}
                now = time.time()
                visible = [(k, t) for k, t in pending.items() if seen.get(k[0], 0) >= k[1]]
                latencies += [now - t for _, t in visible]
                with lock:
                    for k, _ in visible:
                        del produced[k]
            if done.is_set() and not produced:
                break
        publisher.join()
        latencies.sort()
        pick = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3)  # noqa: E731
        return {
            "fresh_events": len(latencies),
            "fresh_not_visible": len(produced),
            "fresh_rate_per_s": rate,
            "fresh_seconds": seconds,
            "load_cycles": cycles,
            "mean_cycle_s": round(cycle_seconds / max(cycles, 1), 3),
            "fresh_p50_s": pick(0.50),
            "fresh_p99_s": pick(0.99),
            "fresh_max_s": round(latencies[-1], 3),
        }


def measure(url: str, pg_dsn: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.from_env({**os.environ, "PIN_CLICKHOUSE_URL": url, "PIN_PG_DSN": pg_dsn})
    with open_clickhouse(url) as ch:  # held open: the embedded engine starts once
        migrate_clickhouse(ch)
        trials = sorted(
            (ingest(ch, settings, kind, args.events, args.groups) for _ in range(args.trials)),
            key=lambda trial: trial["ratio"],
        )
        return {
            "version": ".".join(map(str, ch.server_version)),
            **trials[len(trials) // 2],  # the median trial
            "trial_ratios": [trial["ratio"] for trial in trials],
            **freshness(ch, settings, kind, args.rate, args.seconds, args.groups // 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--paths", default="chdb,server")
    parser.add_argument("--trials", type=int, default=5, help="ingest trials; the median is shown")
    args = parser.parse_args()

    pg_dsn = fresh_database("pin_bench_devstats")
    folder = Path(tempfile.mkdtemp(prefix="pin-bench-devstats-"))
    result: dict[str, Any] = {}
    try:
        for kind in args.paths.split(","):
            where = server_url(folder) if kind == "server" else nullcontext(f"chdb://{folder}/chdb")
            with where as url:
                result[kind] = measure(url, pg_dsn, kind, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["goals"] = {
        "ratio_min": 0.5,
        "embedded_events_per_s_min": 20_000,
        "fresh_p99_s_max": 10.0,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
