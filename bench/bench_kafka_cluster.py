"""Kafka as a production cluster; not a test. Prints ONE JSON line, progress on stderr.

A private 3-node KRaft cluster (stack/kafka_cluster.py: RF 3, min.insync.replicas 2) and a
private single broker (stack/kafka.py: RF 1) of this run, on --base-port (the cluster's 6 ports,
then the broker's 2), in a temporary folder; every node SIGKILLed and reaped at the end (their
data is thrown away). A fresh PostgreSQL database `pin_bench_kcluster` (the outbox, the loader's
counters); the dimension on PIN_BENCH_CLICKHOUSE_SERVER_URL, by default a private Debian
clickhouse-server of this run (bench_devstats.py's): the dimension's database is the fixed
`pin_dev_stats`, and the shared server's is dropped and recreated by other people's tests.

1. Relay: N outbox events (N/10 keys × 10 versions) relayed by ONE `relay_once` (Kafka
   transactions, acks=all) to the single broker, then the same to the cluster. Rate = N / wall
   time; ratio = cluster / single.
2. Loader: N events (G groups round-robin, bench_devstats.py's stream) produced to a fresh topic,
   ONE `load_once` into the dimension, on the single broker, then on the cluster; ratio likewise.
3. Scale-out on the cluster (server path): a fresh topic of 6 partitions pre-filled with N events
   in one Kafka transaction left open, 1 continuous loader (`load_continuously`, a process of
   its own), then another topic and 2 loaders in one consumer group. Once every loader holds
   partitions the transaction commits (the read_committed loaders see the whole backlog at
   once); timed from there to the group's committed offsets at the end offsets. Reported: the
   rate ratio rate(2) / rate(1) (no goal: on 2 cores one loader, the brokers and the server use
   both already), and the cost of scaling out, which does not depend on spare cores: the
   loaders' own CPU-seconds (their processes' CPU clocks, from the commit to the end) per loaded
   event, 2 loaders / 1 loader, goal <= 1.15. --scale-rounds pairs (4), the order
   alternating (1 then 2, then 2 then 1): a phase's cost varies with its place in the run, its
   librdkafka threads' CPU from 0.11 to 0.37 s per 200,000 events whatever the loader count, so
   one pair decided the ratio by where it fell. The ratio is of the means; every phase is
   reported with its CPU by thread (Python's, librdkafka's).
4. Recovery on the cluster: `pin outbox relay` and `pin devstats load` run continuously while
   outbox events are written at R events/s for S seconds (2,000 keys, versions growing); a third
   of the way in, the leader of layout-group partition 0 is SIGKILLed (restarted once the writing
   ends). A read_committed consumer times each event's arrival: reported is the time from the
   kill to the first event written after it that arrives (any partition, and partition 0), and
   the longest arrival gap. Freshness: outbox insert → visible to an argMax read (polled every
   0.25 s), p50/p99/max over the whole run, failover included; goal p99 < 30 s.

"No event lost" is checked in every phase: every outbox event read back from Kafka (the relay's
topic, by Id and Version), every group stored at its last Version, the group's committed offsets
at the end offsets. `lost` and `behind` fields must be 0.

Usage: .venv/bin/python bench/bench_kafka_cluster.py [--events 50000] [--groups 10000]
       [--scale-events 200000] [--scale-rounds 4] [--rate 500] [--seconds 45]
       [--base-port 9500]
       [--phases relay,loader,scale,recovery]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fresh_database, load_average, log, quantiles
from _cpu import process_cpu_seconds
from bench_clickhouse_cluster import produce_stream, timed_load
from bench_devstats import VISIBLE, Groups, fresh_options, produce, server_url
from bench_relay import insert_events

from pin_pipelines.clickhouse import migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.literals import UuidSet
from pin_pipelines.config import Settings
from pin_pipelines.db import connect
from pin_pipelines.devstats.dim import stored_versions
from pin_pipelines.devstats.loader import LoadOptions, load_continuously
from pin_pipelines.devstats.offsets import DEFAULT_GROUP, commit_offsets, kafka_consumer
from pin_pipelines.kafka import (
    ALL_TOPICS,
    TOPIC_LAYOUT_GROUP,
    TopicPolicy,
    admin,
    client_config,
    ensure_topics,
    while_settling,
)
from pin_pipelines.relay import relay_once, topic_end_offsets
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.process import read_pid, wait_until

#: The sections, in the order they run (--phases picks some).
PHASES = ("relay", "loader", "scale", "recovery")

PIN = str(Path(sys.executable).with_name("pin"))
Event = tuple[str, int]  # (group Id, Version)


# --- the private Kafka ------------------------------------------------------------------------


def private_kafka(folder: Path, base_port: int) -> tuple[LocalKafkaCluster, LocalKafka]:
    """The run's cluster and single broker (the stack's downloaded jars linked, not fetched)."""
    cluster = LocalKafkaCluster(
        Settings.from_env(
            {
                "PIN_STATE_DIR": str(folder / "cluster"),
                "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{base_port}",
            }
        ),
        3,
    )
    single = LocalKafka(
        Settings.from_env(
            {
                "PIN_STATE_DIR": str(folder / "single"),
                "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{base_port + 6}",
            }
        )
    )
    shared = LocalKafka(Settings.from_env()).libs
    for libs in (cluster.libs, single.libs):
        libs.parent.mkdir(parents=True, exist_ok=True)
        if shared.exists():
            libs.symlink_to(shared)
    return cluster, single


def kill(pidfile: Path) -> None:
    """SIGKILL and reap (the nodes are this process's children); a no-op on a dead node."""
    pid = read_pid(pidfile)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def settings_for(bootstrap: str, pg_dsn: str, clickhouse_url: str, folder: Path) -> Settings:
    return Settings.from_env({**os.environ, **env_for(bootstrap, pg_dsn, clickhouse_url, folder)})


def env_for(bootstrap: str, pg_dsn: str, clickhouse_url: str, folder: Path) -> dict[str, str]:
    return {
        "PIN_PG_DSN": pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        "PIN_CLICKHOUSE_URL": clickhouse_url,
        "PIN_STATE_DIR": str(folder),
        "PIN_RELAY_TRANSACTIONAL_ID": f"pin-bench-kcluster-{uuid.uuid4().hex[:8]}",
        "PIN_DEVSTATS_MAX_LOAD_RUNS": "2",
    }


def replication_factor(bootstrap: str) -> int:
    partitions = admin(bootstrap).list_topics(TOPIC_LAYOUT_GROUP, timeout=10)
    return min(len(p.replicas) for p in partitions.topics[TOPIC_LAYOUT_GROUP].partitions.values())


def read_back(bootstrap: str, topic: str, start: dict[int, int]) -> set[Event]:
    """(Id, Version) of every committed event from `start` to the topic's end of now."""
    ends = topic_end_offsets(bootstrap, [topic])[topic]
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-read-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    waiting = {p for p, end in ends.items() if end > start.get(p, 0)}
    consumer.assign([TopicPartition(topic, p, start.get(p, 0)) for p in waiting])
    found: set[Event] = set()
    deadline = time.monotonic() + 120
    try:
        while waiting and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                err = msg.error()
                if err is None:
                    body = json.loads(msg.value() or b"{}")
                    found.add((body["Id"], body["Version"]))
                elif err.code() == KafkaError._PARTITION_EOF:
                    if (msg.offset() or 0) >= ends[msg.partition() or 0]:
                        waiting.discard(msg.partition() or 0)
                else:
                    raise KafkaException(err)
    finally:
        consumer.close()
    return found


def group_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    with kafka_consumer(bootstrap, group) as reader:
        partitions = reader.list_topics(topic, timeout=10).topics[topic].partitions
        found = reader.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
    return {tp.partition: tp.offset for tp in found}


def at_end(bootstrap: str, group: str, topic: str) -> bool:
    ends = topic_end_offsets(bootstrap, [topic])[topic]
    return group_offsets(bootstrap, group, topic) == ends


def members_holding(bootstrap: str, group: str) -> int:
    """Members of `group` holding partitions (the coordinator's assignment); a coordinator still
    settling on a fresh cluster (NOT_COORDINATOR) is waited for."""
    client = admin(bootstrap)

    def describe(left: float) -> Any:
        [future] = client.describe_consumer_groups([group]).values()
        return future.result(timeout=min(left, 15))

    described = while_settling(describe, 30)
    return sum(1 for m in described.members if m.assignment.topic_partitions)


def behind(clickhouse_url: str, stream: Groups, events: int) -> int:
    """Groups of `stream` whose stored version is not the last of the `events` produced."""
    last = {
        uuid.UUID(gid): (events - 1 - g) // len(stream.ids) + 1
        for g, gid in enumerate(stream.ids[:events])
    }
    with open_clickhouse(clickhouse_url) as ch:
        stored = stored_versions(ch, list(last))
    return sum(1 for gid, version in last.items() if stored.get(gid.int) != version)


def timed(what: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    """monotonic() when `what()` first holds (polled every `step`)."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout}s")
        time.sleep(step)
    return time.monotonic()


# --- 1, 2: relay and loader throughput ----------------------------------------------------------


def relay_throughput(settings: Settings, events: int) -> dict[str, Any]:
    bootstrap = settings.kafka_bootstrap
    start = topic_end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
    with connect(settings.pg_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE chessboard.outbox_events")
        insert_events(conn, events, [str(uuid.uuid4()) for _ in range(events // 10)])
        rows = conn.execute(
            "SELECT payload->>'Id', (payload->>'Version')::int FROM chessboard.outbox_events"
        ).fetchall()
        conn.execute("VACUUM ANALYZE chessboard.outbox_events")
    started = time.perf_counter()
    summary = relay_once(settings)
    seconds = time.perf_counter() - started
    with connect(settings.pg_dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()
    arrived = read_back(bootstrap, TOPIC_LAYOUT_GROUP, start)
    return {
        "events_per_s": round(events / seconds),
        "published": summary.published,
        "outbox_left": left[0] if left else None,
        "lost": len(set(rows) - arrived),
    }


def loader_throughput(settings: Settings, events: int, groups: int) -> dict[str, Any]:
    with fresh_options("kcluster", settings.kafka_bootstrap) as options:
        stream = produce_stream(settings.kafka_bootstrap, options.topic, events, groups)
        seconds = timed_load(settings, options, events)  # asserts complete, all consumed
        at_the_end = at_end(settings.kafka_bootstrap, options.group, options.topic)
    return {
        "events_per_s": round(events / seconds),
        "committed_at_end": at_the_end,
        "behind": behind(settings.clickhouse_url, stream, events),
    }


# --- 3: one loader vs two -----------------------------------------------------------------------


def _loader_worker(env: dict[str, str], options: dict[str, str], stop: Any, out: Any) -> None:
    """A continuous loader in its own process until the multiprocessing Event `stop` is set;
    its summary goes to the queue `out`."""
    summary = load_continuously(
        Settings.from_env(env),
        LoadOptions(**options, max_seconds=float("inf"), should_stop=stop.is_set),
    )
    out.put({"consumed": summary.consumed, "batches": summary.batches})


def held_back(bootstrap: str, topic: str, events: int, groups: int) -> tuple[Groups, Producer]:
    """`events` of `groups` groups round-robin in ONE open Kafka transaction: in the log, but
    invisible to the read_committed loaders until the returned producer commits it."""
    producer = Producer(
        {
            **client_config(bootstrap),
            "transactional.id": f"pin-bench-prefill-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": 600_000,
            "linger.ms": 5,
            "log_level": 0,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    stream, now = Groups(groups), datetime.now(UTC)
    for i in range(events):
        produce(producer, topic, *stream.event(i, now))
    assert producer.flush(120) == 0
    return stream, producer


def scale_out(settings: Settings, events: int, groups: int, loaders: int) -> dict[str, Any]:
    """The topic is filled in a transaction left open while the loaders start and the group
    gives each its partitions; the clock starts when it commits, so that all of them start on
    the whole backlog at once (no loader alone on it while the other one starts)."""
    bootstrap = settings.kafka_bootstrap
    context = multiprocessing.get_context("spawn")
    with fresh_options(f"scale{loaders}", bootstrap) as options:
        stream, producer = held_back(bootstrap, options.topic, events, groups)
        names = {"topic": options.topic, "group": options.group, "dlq_topic": options.dlq_topic}
        env = {
            **os.environ,
            **env_for(bootstrap, settings.pg_dsn, settings.clickhouse_url, settings.state_dir),
        }
        stop, summaries = context.Event(), context.Queue()
        workers = [
            context.Process(target=_loader_worker, args=(env, names, stop, summaries))
            for _ in range(loaders)
        ]
        for worker in workers:
            worker.start()
        try:
            timed(lambda: members_holding(bootstrap, options.group) == loaders, 120, 0.2)
            producer.commit_transaction(60)
            released = time.monotonic()
            threads_at_release = loader_threads_cpu(workers)
            cpu_at_release = loaders_cpu(workers)
            done = timed(lambda: at_end(bootstrap, options.group, options.topic), 600, 0.1)
            cpu = loaders_cpu(workers) - cpu_at_release
            threads = loader_threads_cpu(workers)
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
    # After the joins: each summary is a few bytes, in the pipe before its process ended.
    loaded = [summaries.get(timeout=5) for _ in workers]
    return {
        "loaders": loaders,
        "events_per_s": round(events / (done - released)),
        "loader_cpu_us_per_event": round(cpu / events * 1e6, 2),
        "thread_cpu_s": {
            kind: round(seconds - threads_at_release.get(kind, 0.0), 3)
            for kind, seconds in threads.items()
        },
        "events_per_batch": [round(x["consumed"] / max(1, x["batches"])) for x in loaded],
        "behind": behind(settings.clickhouse_url, stream, events),
    }


def scale_out_rounds(settings: Settings, events: int, groups: int, rounds: int) -> dict[str, Any]:
    """`rounds` of scale_out with 1 and 2 loaders, the order alternating (1, 2, then 2, 1, ...):
    a phase's cost drifts with its place in the run (the brokers' and the server's state, the
    machine's load), and one pair measured in one order carries that drift into the ratio.
    The ratios are of the means over the rounds; every phase is reported."""
    phases: dict[str, list[dict[str, Any]]] = {"1": [], "2": []}
    for round_number in range(rounds):
        for loaders in (1, 2) if round_number % 2 == 0 else (2, 1):
            log(f"scale-out round {round_number + 1}: {loaders} loader(s)")
            phases[str(loaders)].append(scale_out(settings, events, groups, loaders))

    def mean(loaders: str, key: str) -> float:
        return sum(phase[key] for phase in phases[loaders]) / len(phases[loaders])

    return {
        **phases,
        "ratio": round(mean("2", "events_per_s") / mean("1", "events_per_s"), 3),
        "cpu_per_event_ratio": round(
            mean("2", "loader_cpu_us_per_event") / mean("1", "loader_cpu_us_per_event"), 3
        ),
        "cpu_per_event_ratio_by_round": [
            round(two["loader_cpu_us_per_event"] / one["loader_cpu_us_per_event"], 3)
            for one, two in zip(phases["1"], phases["2"], strict=True)
        ],
    }


def loader_threads_cpu(workers: list[Any]) -> dict[str, float]:
    """The loader processes' CPU-seconds so far by thread kind: `python` (the loader's own
    thread and Python's), `librdkafka` (its `rdk:` threads: fetches, decompression, the group's
    protocol). From each task's schedstat (nanoseconds on CPU); a thread that ended is missed."""
    found: dict[str, float] = {"python": 0.0, "librdkafka": 0.0}
    for worker in workers:
        for task in Path(f"/proc/{worker.pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError):
                continue
            found["librdkafka" if name.startswith("rdk:") else "python"] += seconds
    return found


def loaders_cpu(workers: list[Any]) -> float:
    """The loader processes' CPU-seconds so far (each one's CPU clock)."""
    found = [process_cpu_seconds(worker.pid) for worker in workers]
    assert None not in found, "a loader process ended before the load did"
    return sum(cpu for cpu in found if cpu is not None)


# --- 4: recovery across a leader kill -----------------------------------------------------------


class Arrivals:
    """A read_committed consumer of the layout-group topic from its end of now, in a thread:
    each event's (Id, Version) → (partition, arrival time)."""

    def __init__(self, bootstrap: str) -> None:
        self.seen: dict[Event, tuple[int, float]] = {}
        self.stop = threading.Event()
        start = topic_end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
        self.consumer = Consumer(
            {
                **client_config(bootstrap),
                "group.id": f"bench-arrivals-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
                "isolation.level": "read_committed",
                "log_level": 0,
            }
        )
        self.consumer.assign([TopicPartition(TOPIC_LAYOUT_GROUP, p, o) for p, o in start.items()])
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            for msg in self.consumer.consume(1000, timeout=0.05):
                if msg.error() is None:
                    body = json.loads(msg.value() or b"{}")
                    self.seen[(body["Id"], body["Version"])] = (msg.partition() or 0, time.time())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.consumer.close()


class Freshness:
    """Polls the dimension every 0.25 s with an argMax read: when each written (Id, Version)
    (or a newer one) first became visible, minus its outbox insert time."""

    def __init__(self, clickhouse_url: str) -> None:
        self.clickhouse_url = clickhouse_url
        self.pending: dict[Event, float] = {}
        self.lags: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll)
        self.thread.start()

    def written(self, events: list[Event], at: float) -> None:
        with self.lock:
            self.pending.update((event, at) for event in events)

    def _poll(self) -> None:
        with open_clickhouse(self.clickhouse_url) as ch:
            while not self.stop.wait(0.25):
                with self.lock:
                    pending = dict(self.pending)
                if not pending:
                    continue
                ids = UuidSet(sorted({uuid.UUID(gid) for gid, _ in pending}))
                seen = {str(gid): int(v) for gid, v in ch.rows(VISIBLE, {"ids": ids})}
                now = time.time()
                visible = [e for e in pending if seen.get(e[0], 0) >= e[1]]
                with self.lock:
                    for event in visible:
                        self.lags.append(now - self.pending.pop(event))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def commit_at_end(bootstrap: str) -> None:
    """The loader group starts at the topic's end: phase 1's events are not this phase's."""
    ends = topic_end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
    with kafka_consumer(bootstrap, DEFAULT_GROUP) as committer:
        commit_offsets(
            committer, [TopicPartition(TOPIC_LAYOUT_GROUP, p, o) for p, o in ends.items()]
        )


def stop_pin(process: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM a continuous `pin` command, wait, return its JSON summary."""
    process.send_signal(signal.SIGTERM)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    if process.returncode != 0:
        return {"returncode": process.returncode, "stderr": err[-400:]}
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def recovery(
    cluster: LocalKafkaCluster, settings: Settings, rate: int, seconds: float
) -> dict[str, Any]:
    bootstrap = cluster.bootstrap
    commit_at_end(bootstrap)
    env = {
        **os.environ,
        **env_for(bootstrap, settings.pg_dsn, settings.clickhouse_url, settings.state_dir),
    }
    arrivals, fresh = Arrivals(bootstrap), Freshness(settings.clickhouse_url)
    commands = [[PIN, "outbox", "relay"], [PIN, "devstats", "load"]]
    relay, loader = (
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    )
    keys = [str(uuid.uuid4()) for _ in range(2000)]
    per_tick, ticks = max(1, rate // 10), int(seconds * 10)
    rounds = len(keys) // per_tick
    written: dict[Event, float] = {}
    victim, killed_at = -1, 0.0
    try:
        with connect(settings.pg_dsn, autocommit=True) as conn:
            begin = time.monotonic()
            for tick in range(ticks):
                if tick == ticks // 3:
                    victim = int(
                        admin(bootstrap)
                        .list_topics(TOPIC_LAYOUT_GROUP, timeout=10)
                        .topics[TOPIC_LAYOUT_GROUP]
                        .partitions[0]
                        .leader
                    )
                    killed_at = time.time()
                    kill(cluster.nodes[victim - 1].pidfile)
                    log("leader of partition 0 killed", node=victim)
                chunk = keys[(tick % rounds) * per_tick : (tick % rounds + 1) * per_tick]
                version = tick // rounds + 1
                at = time.time()
                insert_events(conn, per_tick, chunk, version)
                written.update(((key, version), at) for key in chunk)
                fresh.written([(key, version) for key in chunk], at)
                time.sleep(max(0.0, begin + (tick + 1) / 10 - time.monotonic()))
        cluster.up()  # the killed node back
        log("writing done, killed node restarted; waiting for the pipeline to catch up")
        with contextlib.suppress(TimeoutError):
            timed(
                lambda: not fresh.pending and at_end(bootstrap, DEFAULT_GROUP, TOPIC_LAYOUT_GROUP),
                180,
                0.5,
            )
    finally:
        summaries = [stop_pin(relay), stop_pin(loader)]
        fresh.close()
        arrivals.close()
    with connect(settings.pg_dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()
    after = [
        (arrived - killed_at, partition)
        for event, (partition, arrived) in arrivals.seen.items()
        if written.get(event, 0.0) >= killed_at
    ]
    arrived_at = sorted(t for _, t in arrivals.seen.values())
    gaps = [b - a for a, b in itertools.pairwise(arrived_at)]
    lags = quantiles(fresh.lags) if fresh.lags else {}
    return {
        "rate_per_s": rate,
        "seconds": seconds,
        "events_written": len(written),
        "killed_node": victim,
        "first_delivered_after_kill_s": round(min(t for t, _ in after), 2) if after else None,
        "partition0_first_after_kill_s": round(min((t for t, p in after if p == 0), default=-1), 2),
        "longest_arrival_gap_s": round(max(gaps, default=0.0), 2),
        "fresh_p50_s": round(lags["p50_ms"] / 1000, 2) if lags else None,
        "fresh_p99_s": round(lags["p99_ms"] / 1000, 2) if lags else None,
        "fresh_max_s": round(max(fresh.lags), 2) if fresh.lags else None,
        "lost": len(set(written) - set(arrivals.seen)),
        "not_visible": len(fresh.pending),
        "outbox_left": left[0] if left else None,
        "relay_summary": summaries[0],
        "loader_summary": summaries[1],
    }


# --- the run ------------------------------------------------------------------------------------


def leaders_elected(bootstrap: str, topic: str) -> bool:
    """Every partition of `topic` has a leader. A topic just created may be missing from a
    broker's metadata for a moment (not yet propagated to it): not ready yet, not an error."""
    found = admin(bootstrap).list_topics(topic, timeout=5).topics.get(topic)
    return (
        found is not None
        and found.error is None
        and all(p.leader >= 0 for p in found.partitions.values())
    )


@contextlib.contextmanager
def private_stack(base_port: int) -> Iterator[tuple[LocalKafkaCluster, LocalKafka, Path]]:
    folder = Path(tempfile.mkdtemp(prefix="pin-bench-kcluster-"))
    cluster, single = private_kafka(folder, base_port)
    try:
        single.up()
        cluster.up()
        for bootstrap in (single.settings.kafka_bootstrap, cluster.bootstrap):
            ensure_topics(bootstrap, ALL_TOPICS, TopicPolicy())
        wait_until(
            lambda: leaders_elected(cluster.bootstrap, TOPIC_LAYOUT_GROUP),
            timeout=60,
            what="a leader for every partition",
        )
        yield cluster, single, folder
    finally:
        for pidfile in [single.pidfile, *(node.pidfile for node in cluster.nodes)]:
            kill(pidfile)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--scale-events", type=int, default=200_000)
    parser.add_argument(
        "--scale-rounds",
        type=int,
        default=4,
        help="rounds of the scale phase, each one loader and two, in alternating order",
    )
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--base-port", type=int, default=9500)
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="a subset of " + ",".join(PHASES)
    )
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    assert phases <= set(PHASES), args.phases

    result: dict[str, Any] = {"load_average_before": load_average()}
    pg_dsn = fresh_database("pin_bench_kcluster")
    with (
        private_stack(args.base_port) as (cluster, single, folder),
        server_url(folder) as clickhouse_url,
    ):
        with open_clickhouse(clickhouse_url) as ch:
            migrate_clickhouse(ch)
        on = {
            kind: settings_for(bootstrap, pg_dsn, clickhouse_url, folder / "state")
            for kind, bootstrap in (
                ("single", single.settings.kafka_bootstrap),
                ("cluster", cluster.bootstrap),
            )
        }
        result["replication_factor"] = {
            k: replication_factor(s.kafka_bootstrap) for k, s in on.items()
        }
        for phase, measure in (
            ("relay", lambda s: relay_throughput(s, args.events)),
            ("loader", lambda s: loader_throughput(s, args.events, args.groups)),
        ):
            if phase not in phases:
                continue
            found = {}
            for kind, settings in on.items():
                log(f"{phase} on the {kind}")
                found[kind] = measure(settings)
            found["ratio"] = round(
                found["cluster"]["events_per_s"] / found["single"]["events_per_s"], 3
            )
            result[phase] = found
        if "scale" in phases:
            result["scale_out"] = scale_out_rounds(
                on["cluster"], args.scale_events, args.groups, args.scale_rounds
            )
        if "recovery" in phases:
            log("recovery")
            result["recovery"] = recovery(cluster, on["cluster"], args.rate, args.seconds)
    result["load_average_after"] = load_average()
    result["goals"] = {
        "scale_out_cpu_per_event_ratio_max": 1.15,
        "fresh_p99_s_max": 30.0,
        "lost": 0,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
