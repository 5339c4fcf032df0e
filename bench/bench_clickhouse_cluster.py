"""dim_layout_group on a ClickHouse cluster; not a test. Prints ONE JSON line.

A private cluster of this run (ZooKeeper and three Debian clickhouse-server 18.16: shard 1 with
replicas s1r1 and s1r2, shard 2 with s2r1; stack/clickhouse_cluster.py, on --base-port) and a
private single server, both in a temporary folder under --data-dir, both migrated (the cluster ON
CLUSTER, the loader's client talking to s1r1).

--data-dir is /dev/shm (tmpfs) by default, and the run reports the system CPU one file creation
costs there (`file_create_us`, 2,000 files of 4 KB). On this project's machines the disk's ext4
spends that CPU in ext4_create → recently_deleted (perf), the scan for an inode not freed in the
last minutes, which ext4 does when it has no journal: so a file costs more the more files were
deleted near it lately. Measured with the probe: /tmp 27 µs, then 295 µs right after the probe
had deleted its 2,000 files there; 3,000 files in a folder of a finished run 1.2-1.5 s (400-500
µs each); /dev/shm 6-12 µs. ClickHouse keeps creating and deleting files (a part of 18.16 is 20
files; merges delete the parts they replace), and the cluster writes three parts per 1,000 events
where one server writes one (two shards, and shard 1's second replica fetches its copy): on that
disk the ratio measures the inode allocator more than the cluster, and drifts within a run. On
tmpfs ZooKeeper's fsyncs are free too (≈ 1.5 ms each on the disk, in every insert's answer). Pass
--data-dir on the disk to see it (docs/benchmarks.md: both figures).

1. Loader throughput, cluster vs one server, in the same run: N events (G groups round-robin,
   bench_devstats.py's stream) are produced once; ONE `load_once` loads them into the single
   server and one into the cluster, each through a consumer group of its own (so both read the
   very same events), in alternating order over T trials. Rate = N / wall time of the call.
   Ratio = cluster / single per trial; the median trial is shown. Goal: ratio >= 0.5. With each
   phase, the CPU its servers spent (the single server; the cluster's three and ZooKeeper) from
   the load's start until their merges are done, per 1,000 events: the cluster does the work of
   replication (a second copy of shard 1, ZooKeeper round trips) on the same 2 cores.
2. argMax read through the Distributed table: `labels` (spec 003's read, the actor's developer
   scope) for 1,000 groups of one developer, each stored in 5 versions (unmerged: the read does
   the argMax work), R times; p50/p99, and the same read on the single server.
3. Catch-up: s1r2 is stopped (SIGTERM), E events (one version of E groups) are loaded through
   s1r1, s1r2 is started again; reported are the seconds until it answers, until it replicates
   (its queue loaded from ZooKeeper) and until it holds every group s1r1 has with an empty
   replication queue and no delay, plus the parts it fetched. Then the same after a kill -9,
   where it can replicate only once the killed process's ZooKeeper session has expired (5 s
   here) and 18.16 retries that every 10 s.

Usage: .venv/bin/python bench/bench_clickhouse_cluster.py [--events 50000] [--groups 10000]
       [--trials 5] [--reads 300] [--catch-up-events 10000] [--base-port 9400]
       [--data-dir /dev/shm]
Uses PIN_KAFKA_BOOTSTRAP and PIN_PG_DSN's server (a fresh `pin_bench_chcluster` database for
the loader's counters); topics and consumer groups are unique per run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fresh_database, quantiles
from bench_devstats import Groups, fresh_options, new_producer, produce

from pin_pipelines.clickhouse import ServerAddress, migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.cluster import LOCAL_SUFFIX
from pin_pipelines.config import Settings
from pin_pipelines.devstats.dim import TABLE, labels
from pin_pipelines.devstats.events import COLUMNS
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.stack.clickhouse_cluster import ClusterNode, LocalClickHouseCluster
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import free_port, pid_alive, read_pid

LOCAL = f"{TABLE}{LOCAL_SUFFIX}"


def file_create_us(folder: Path, files: int = 2000) -> float:
    """System CPU per file created (and written to) in `folder`, in microseconds."""
    probe = Path(tempfile.mkdtemp(dir=folder))
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        for i in range(files):
            (probe / str(i)).write_bytes(b"x" * 4096)
        spent = resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
        return round(spent / files * 1e6, 1)
    finally:
        shutil.rmtree(probe)


def settle(urls: list[str], timeout: float = 120.0) -> None:
    """Until no server merges anything, and the page cache is written back: the previous
    phase's background work must not slow down the next one."""
    deadline = time.monotonic() + timeout
    for url in urls:
        with open_clickhouse(url) as ch:
            while ch.rows("SELECT count() FROM system.merges")[0][0]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    os.sync()


def produce_stream(bootstrap: str, topic: str, events: int, groups: int) -> Groups:
    """`events` of `groups` groups round-robin; returns the groups (to check what was stored)."""
    stream, producer, now = Groups(groups), new_producer(bootstrap), datetime.now(UTC)
    for i in range(events):
        produce(producer, topic, *stream.event(i, now))
    assert producer.flush(60) == 0
    return stream


def timed_load(settings: Settings, options: LoadOptions, events: int) -> float:
    started = time.perf_counter()
    summary = load_once(settings, options)
    seconds = time.perf_counter() - started
    assert summary.complete and summary.consumed == events, summary.as_dict()
    return seconds


def pid_of(pidfile: Path) -> int:
    pid = read_pid(pidfile)
    assert pid is not None, f"nothing runs from {pidfile}"
    return pid


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU the processes used so far (/proc/<pid>/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def throughput(
    single: Settings,
    cluster: Settings,
    pids: dict[str, list[int]],
    settle_urls: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Median trial of cluster vs single-server ingest of the same events, with the CPU the
    servers (and ZooKeeper) spent on it until their merges were done."""
    trials = []
    for trial in range(args.trials):
        with fresh_options("cluster", single.kafka_bootstrap) as options:
            produce_stream(single.kafka_bootstrap, options.topic, args.events, args.groups)
            phases: list[tuple[str, Settings]] = [("single", single), ("cluster", cluster)]
            seconds, cpu = {}, {}
            for kind, settings in phases if trial % 2 == 0 else phases[::-1]:
                settle(settle_urls)
                before = cpu_seconds(pids[kind])
                seconds[kind] = timed_load(
                    settings, replace(options, group=f"{options.group}-{kind}"), args.events
                )
                settle(settle_urls)
                cpu[kind] = cpu_seconds(pids[kind]) - before
        rates = {kind: args.events / s for kind, s in seconds.items()}
        trials.append(
            {
                "single_events_per_s": round(rates["single"]),
                "cluster_events_per_s": round(rates["cluster"]),
                "ratio": round(rates["cluster"] / rates["single"], 3),
                "single_server_cpu_ms_per_1000": round(cpu["single"] / args.events * 1e6, 1),
                "cluster_servers_cpu_ms_per_1000": round(cpu["cluster"] / args.events * 1e6, 1),
            }
        )
    trials.sort(key=lambda t: t["ratio"])
    return {
        "events": args.events,
        "groups": args.groups,
        **trials[len(trials) // 2],
        "trial_ratios": [t["ratio"] for t in trials],
    }


def read_latency(url: str, reads: int) -> dict[str, Any]:
    """p50/p99 of `labels` for 1,000 groups of one developer, 5 unmerged versions each."""
    developer, ids = uuid.uuid4(), [uuid.uuid4() for _ in range(1000)]
    base = datetime.now(UTC)
    with open_clickhouse(url) as ch:
        for version in range(1, 6):
            ch.insert(
                TABLE,
                COLUMNS,
                [
                    (
                        gid,
                        uuid.uuid4(),
                        developer,
                        f"v{version}",
                        version,
                        0,
                        version,
                        base + timedelta(seconds=version),
                    )
                    for gid in ids
                ],
            )
        assert set(labels(ch, developer, ids).values()) == {"v5"}
        timings = []
        for _ in range(reads):
            started = time.perf_counter()
            labels(ch, developer, ids)
            timings.append(time.perf_counter() - started)
    found = quantiles(timings)
    return {"read_p50_ms": found["p50_ms"], "read_p99_ms": found["p99_ms"], "reads": reads}


def wait(what: Callable[[], bool], timeout: float = 300.0) -> float:
    """Seconds until `what()` holds (polled every 50 ms)."""
    started = time.monotonic()
    while not what():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - started


def scalar(node: ClusterNode, sql: str) -> int:
    with open_clickhouse(node.url) as ch:
        return int(ch.rows(sql)[0][0])


def catch_up(
    cluster: LocalClickHouseCluster, settings: Settings, events: int, *, crash: bool
) -> dict[str, Any]:
    """s1r2 down (stopped, or killed with -9 when `crash`) while `events` events load through
    s1r1, then started: how long until it has caught up."""
    primary, lagging = cluster.node("s1r1"), cluster.node("s1r2")
    if crash:
        pid = pid_of(lagging.pidfile)
        os.kill(pid, signal.SIGKILL)
        wait(lambda: not pid_alive(pid))
    else:
        lagging.down()
    with fresh_options("catchup", settings.kafka_bootstrap) as options:
        produce_stream(settings.kafka_bootstrap, options.topic, events, events)
        timed_load(settings, options, events)
    # Distinct groups, not rows: merges collapse versions on either replica at any time.
    groups = scalar(primary, f"SELECT uniqExact(LayoutGroupId) FROM {LOCAL}")

    started = time.monotonic()
    lagging.up()  # returns once it answers and reaches ZooKeeper
    answers = time.monotonic() - started
    replicating: list[float] = []

    def caught_up() -> bool:
        with open_clickhouse(lagging.url) as ch:
            [(queue, delay)] = ch.rows("SELECT queue_size, absolute_delay FROM system.replicas")
            [(stored,)] = ch.rows(f"SELECT uniqExact(LayoutGroupId) FROM {LOCAL}")
        # Until its queue is first loaded, 18.16 reports the delay as the whole epoch.
        if delay < 10**9 and not replicating:
            replicating.append(time.monotonic() - started)
        return queue == 0 and delay == 0 and stored >= groups

    wait(caught_up)
    total = time.monotonic() - started
    fetched = scalar(
        lagging, "SELECT sum(value) FROM system.events WHERE event = 'ReplicatedPartFetches'"
    )
    return {
        "events": events,
        "shard1_groups": groups,
        "answers_s": round(answers, 2),
        "replicating_s": round(replicating[0], 2),
        "caught_up_s": round(total, 2),
        "parts_fetched": fetched,  # a restarted server counts from zero
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--catch-up-events", type=int, default=10_000)
    parser.add_argument("--base-port", type=int, default=9400)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where the servers' and ZooKeeper's folders go (default /dev/shm: see the doc)",
    )
    args = parser.parse_args()

    pg_dsn = fresh_database("pin_bench_chcluster")
    folder = Path(tempfile.mkdtemp(prefix="pin-bench-chcluster-", dir=args.data_dir))
    server = LocalClickHouseServer(ServerAddress("127.0.0.1", free_port(), "default", ""), folder)
    cluster = LocalClickHouseCluster("pin", folder, base_port=args.base_port)
    single_url = f"clickhouse://default@127.0.0.1:{server.address.port}/pin_dev_stats"
    result: dict[str, Any] = {
        "data_dir": str(folder.parent),
        "file_create_us": file_create_us(folder),
    }
    try:
        server.up()
        cluster.up()
        for url, name in ((single_url, None), (cluster.url(), cluster.name)):
            with open_clickhouse(url) as ch:
                migrate_clickhouse(ch, name)
                result.setdefault("version", ".".join(map(str, ch.server_version)))
        env = {**os.environ, "PIN_PG_DSN": pg_dsn}
        single = Settings.from_env({**env, "PIN_CLICKHOUSE_URL": single_url})
        on_cluster = Settings.from_env({**env, "PIN_CLICKHOUSE_URL": cluster.url()})
        settle_urls = [single_url] + [node.url for node in cluster.nodes]
        pids = {
            "single": [pid_of(server.pidfile)],
            "cluster": [pid_of(cluster.zookeeper.pidfile)]
            + [pid_of(node.pidfile) for node in cluster.nodes],
        }
        result["throughput"] = throughput(single, on_cluster, pids, settle_urls, args)
        settle(settle_urls)
        result["read_1000_ids_cluster"] = read_latency(cluster.url(), args.reads)
        result["read_1000_ids_single"] = read_latency(single_url, args.reads)
        result["catch_up_after_stop"] = catch_up(
            cluster, on_cluster, args.catch_up_events, crash=False
        )
        result["catch_up_after_kill_9"] = catch_up(
            cluster, on_cluster, args.catch_up_events, crash=True
        )
    finally:
        cluster.down()
        server.down()
        shutil.rmtree(folder, ignore_errors=True)
    result["goals"] = {"ratio_min": 0.5}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
