"""Spec 003's dimension on a replicated, sharded ClickHouse cluster.

ZooKeeper and three Debian clickhouse-server 18.16 (shard 1 = s1r1 + s1r2, shard 2 = s2r1), real
Kafka and PostgreSQL. The spec's behaviour tests run on the local cluster of `pin stack up
--clickhouse-cluster` from test_devstats_loader.py; these cover what only a cluster has: the ON
CLUSTER migration, sharding, a replica killed with -9 while the loader runs, a whole shard down,
ZooKeeper down, `pin stack down`, and the reconciliation asset and check on the Distributed table.

Tests that only read the stack's cluster or write groups of their own use it (`clickhouse_cluster`).
Tests that kill a server or ZooKeeper, stop the cluster, or swap or empty the dimension use this
module's own cluster (`cluster`: the same topology on free ports in a temporary folder, started
once): the stack's cluster is a shared service that other test sessions on the machine load into
meanwhile. A test that kills a process of the module's cluster brings it back in `finally`, so it
is whole for the next test; it is stopped at the end of the module.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pin_pipelines.clickhouse import (
    ClickHouse,
    ClickHouseUnavailable,
    migrate_clickhouse,
    open_clickhouse,
)
from pin_pipelines.clickhouse.cluster import LOCAL_SUFFIX
from pin_pipelines.clickhouse.migrate import JOURNAL_TABLE, journal
from pin_pipelines.config import Settings
from pin_pipelines.definitions import defs
from pin_pipelines.defs.reconcile.assets import dim_layout_group_drift as drift_asset
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.devstats.dim import TABLE, insert_events, labels, stored_versions
from pin_pipelines.devstats.events import COLUMNS, parse_event
from pin_pipelines.devstats.loader import (
    LoadOptions,
    LoadSummary,
    load_continuously,
    load_once,
)
from pin_pipelines.errors import PinError
from pin_pipelines.reconcile import dim_layout_group_drift, reconcile
from pin_pipelines.stack.clickhouse_cluster import (
    DEFAULT_CLUSTER,
    ClusterNode,
    LocalClickHouseCluster,
)
from pin_pipelines.stack.process import free_port_run, pid_alive, port_open, read_pid, wait_until
from tests.support.chessboard import small_project
from tests.support.cli import assert_one_line_error, run_pin, summary
from tests.support.clickhouse import cluster_in_sync, settings_for
from tests.support.clickhouse_migrations import ADD_NOTE, migrate_while_loading, with_migration
from tests.support.devstats import Group, committed, end_offsets, physical_rows, produce_events
from tests.support.loaders import loader_env

#: It drops, truncates and stops servers of the stack's shared ClickHouse cluster: the modules
#: whose tests also run on the cluster run one after another with it, on one worker.
pytestmark = pytest.mark.xdist_group("clickhouse-cluster")

LOCAL = f"{TABLE}{LOCAL_SUFFIX}"


# --- helpers -----------------------------------------------------------------------------------


def kill_9(pidfile: Path) -> None:
    """SIGKILL the process of `pidfile` and wait until it is gone."""
    pid = read_pid(pidfile)
    assert pid is not None, f"nothing runs from {pidfile}"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


def insert_queries(node: ClusterNode) -> int:
    """INSERTs the server ran since it started: a shard's inserts through a Distributed table
    run on one replica, and the others only fetch the parts (which this does not count)."""
    with open_clickhouse(node.url) as ch:
        found = ch.rows("SELECT value FROM system.events WHERE event = 'InsertQuery'")
    return int(found[0][0]) if found else 0


def duplicated_blocks(cluster: LocalClickHouseCluster) -> int:
    """Inserted blocks the replicated tables dropped as duplicates, over every server."""
    total = 0
    for node in cluster.nodes:
        with open_clickhouse(node.url) as ch:
            total += int(
                ch.rows(
                    "SELECT sum(value) FROM system.events WHERE event = 'DuplicatedInsertedBlocks'"
                )[0][0]
            )
    return total


def local_versions(node: ClusterNode) -> dict[uuid.UUID, int]:
    """The newest SourceVersion of each group in one server's shard-local table: what replicas
    of a shard must agree on (their physical rows may differ for a moment, until a merge that
    one has applied reaches the other)."""
    with open_clickhouse(node.url) as ch:
        return {
            uuid.UUID(str(gid)): int(version)
            for gid, version in ch.rows(
                f"SELECT LayoutGroupId, max(SourceVersion) FROM {LOCAL} GROUP BY LayoutGroupId"
            )
        }


def current_versions(url: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    """The spec's read through the Distributed table of the server at `url`."""
    with open_clickhouse(url) as ch:
        return {
            uuid.UUID(str(gid)): int(version)
            for gid, version in ch.rows(
                f"SELECT LayoutGroupId, argMax(SourceVersion, (UpsertedAt, SourceVersion)) "
                f"FROM {TABLE} WHERE LayoutGroupId IN %(ids)s GROUP BY LayoutGroupId",
                {"ids": tuple(ids)},
            )
        }


def load_until_done(settings: Settings, options: LoadOptions, runs: int = 4) -> None:
    """`load_once` again after a failed or cut-short run, as the sensor launches the next one."""
    errors = []
    for _ in range(runs):
        try:
            loaded = load_once(settings, options)
        except ClickHouseUnavailable as exc:
            errors.append(str(exc))
            continue
        if loaded.complete and not any(loaded.lag.values()):
            return
    raise AssertionError(f"the loader did not catch up in {runs} runs: {errors}")


@pytest.fixture(scope="module")
def private_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalClickHouseCluster]:
    """This module's own cluster (ports: a free run of 24 from its base, see
    stack/clickhouse_cluster.py), started from an empty folder as `pin stack up
    --clickhouse-cluster` does and migrated ON CLUSTER; every process stopped at the end."""
    nodes = LocalClickHouseCluster(
        DEFAULT_CLUSTER, tmp_path_factory.mktemp("state"), base_port=free_port_run(24)
    )
    try:
        nodes.up()
        with open_clickhouse(nodes.url()) as ch:
            migrate_clickhouse(ch, nodes.name)
        cluster_in_sync(nodes)
        yield nodes
    finally:
        nodes.down()


@pytest.fixture
def cluster(private_cluster: LocalClickHouseCluster) -> Iterator[LocalClickHouseCluster]:
    """The module's cluster; every server and ZooKeeper running again after the test."""
    try:
        yield private_cluster
    finally:
        private_cluster.up()
        cluster_in_sync(private_cluster)


# --- schema and sharding -----------------------------------------------------------------------

SPEC_COLUMNS = [
    ("LayoutGroupId", "UUID"),
    ("ProjectId", "UUID"),
    ("DeveloperId", "UUID"),
    ("Name", "String"),
    ("SortOrder", "Int32"),
    ("IsArchived", "UInt8"),
    ("SourceVersion", "Int64"),
    ("UpsertedAt", "DateTime"),  # DateTime64(3) on ClickHouse ≥ 20 (legacy.py)
]


def test_the_migration_is_idempotent_on_the_cluster_and_keeps_the_spec_table(
    clickhouse_cluster: LocalClickHouseCluster,
) -> None:
    """Tried: migrating again from each server (the session migrated from s1r1 already). Nothing
    is created twice, and every server has the spec's dimension as a Distributed table sharded by
    a hash of LayoutGroupId over a ReplicatedReplacingMergeTree(UpsertedAt) table with the spec's
    columns and ORDER BY; a server without the cluster is refused with one line."""
    for node in clickhouse_cluster.nodes:
        with open_clickhouse(node.url) as ch:
            assert migrate_clickhouse(ch, clickhouse_cluster.name) == []
            for table in (TABLE, LOCAL):
                assert (
                    ch.rows(
                        "SELECT name, type FROM system.columns "
                        "WHERE database = 'pin_dev_stats' AND table = %(t)s",
                        {"t": table.split(".")[1]},
                    )
                    == SPEC_COLUMNS
                )
            engines: dict[str, str] = dict(
                ch.rows(
                    "SELECT name, engine_full FROM system.tables WHERE database = 'pin_dev_stats'"
                )
            )
        assert engines[TABLE.split(".")[1]] == (
            f"Distributed({clickhouse_cluster.name}, pin_dev_stats, dim_layout_group_local, "
            "cityHash64(toString(LayoutGroupId)))"
        )
        assert engines[LOCAL.split(".")[1]].startswith(
            "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/pin_dev_stats/"
            "dim_layout_group', '{replica}', UpsertedAt) ORDER BY LayoutGroupId"
        )
    with (
        open_clickhouse("clickhouse://default@127.0.0.1:9000/pin_dev_stats") as single,
        pytest.raises(PinError, match="has no such cluster in its remote_servers"),
    ):
        migrate_clickhouse(single, clickhouse_cluster.name)


def test_pin_stack_and_pin_db_migrate_know_the_cluster(
    clickhouse_cluster: LocalClickHouseCluster, pg_dsn: str
) -> None:
    """Tried through the `pin` command: `stack up --clickhouse-cluster` on the running cluster,
    `stack status` without the flag, `db migrate` with PIN_CLICKHOUSE_CLUSTER pointed at s1r2,
    and two bad settings. Up starts nothing and reports ZooKeeper and the three servers with
    their shard and replica, status lists them unasked, migrate creates nothing anew, and a URL
    that is no server of the local cluster or a bad cluster name fail in one line."""
    up = summary(run_pin("stack", "up", "--clickhouse-cluster"))["services"]
    ours = [s for s in up if s["service"] in ("zookeeper", "clickhouse-cluster")]
    assert {s["state"] for s in ours} == {"already running"}
    assert [(s["service"], s.get("shard"), s.get("replica"), s["port"]) for s in ours] == [
        ("zookeeper", None, None, 9300),
        ("clickhouse-cluster", 1, "s1r1", 9301),
        ("clickhouse-cluster", 1, "s1r2", 9302),
        ("clickhouse-cluster", 2, "s2r1", 9303),
    ]
    status = summary(run_pin("stack", "status"))["services"]
    assert [s["state"] for s in status if s["service"] in ("zookeeper", "clickhouse-cluster")] == [
        "running"
    ] * 4

    env = {
        "PIN_PG_DSN": pg_dsn,
        "PIN_CLICKHOUSE_URL": clickhouse_cluster.url("s1r2"),
        "PIN_CLICKHOUSE_CLUSTER": clickhouse_cluster.name,
    }
    assert summary(run_pin("db", "migrate", env=env))["clickhouse_applied"] == []
    lone_server = {**env, "PIN_CLICKHOUSE_URL": "clickhouse://default@127.0.0.1:9000/pin_dev_stats"}
    assert_one_line_error(
        run_pin("stack", "status", env=lone_server), "is not a server of the local cluster pin"
    )
    assert_one_line_error(
        run_pin("stack", "status", env={**env, "PIN_CLICKHOUSE_CLUSTER": "pin-1"}),
        "PIN_CLICKHOUSE_CLUSTER must be a cluster name",
    )


def test_a_single_node_table_under_the_dimension_name_stops_the_migration(
    cluster: LocalClickHouseCluster,
) -> None:
    """Tried: on s2r1, the dimension's name held by a plain ReplacingMergeTree table (as a server
    migrated before PIN_CLICKHOUSE_CLUSTER was set has it). `IF NOT EXISTS` would keep it, and
    the writes through it would never reach the cluster: the migration fails and says why."""
    node = cluster.node("s2r1")
    with open_clickhouse(node.url) as ch:
        ch.command(f"RENAME TABLE {TABLE} TO {TABLE}_aside")
        try:
            ch.command(
                f"CREATE TABLE {TABLE} AS {LOCAL} "
                "ENGINE = ReplacingMergeTree(UpsertedAt) ORDER BY LayoutGroupId"
            )
            with pytest.raises(PinError) as caught:
                migrate_clickhouse(ch, cluster.name)
        finally:
            ch.command(f"DROP TABLE IF EXISTS {TABLE}")
            ch.command(f"RENAME TABLE {TABLE}_aside TO {TABLE}")
    assert "is a ReplacingMergeTree table, not Distributed" in str(caught.value)
    assert "docs/runbook.md" in str(caught.value)


def test_a_server_with_an_empty_disk_gets_its_tables_from_the_current_definition(
    cluster: LocalClickHouseCluster,
) -> None:
    """Tried: every table of s1r2 dropped (a replacement server's empty disk; the journal, read
    through the other servers, holds every migration), then the migration from s1r2, as
    docs/runbook.md says. It makes s1r2's tables from the current definition (ON CLUSTER, IF
    NOT EXISTS: nothing changes elsewhere), every table has its cluster form again, and s1r2's
    replica fetches what its shard holds. (Before this module adds columns: a replica is made
    again only with the columns its shard has.)"""
    s1r1, s1r2 = cluster.node("s1r1"), cluster.node("s1r2")
    with open_clickhouse(s1r1.url) as ch:
        insert_events(ch, [parse_event(json.dumps(Group().event(1)).encode()) for _ in range(10)])
    cluster_in_sync(cluster)
    tables = (TABLE, LOCAL, JOURNAL_TABLE, f"{JOURNAL_TABLE}{LOCAL_SUFFIX}")
    with open_clickhouse(s1r2.url) as ch:
        for table in tables:
            ch.command(f"DROP TABLE {table}")
        migrate_clickhouse(ch, cluster.name)
        for table in tables:
            assert ch.rows(f"EXISTS TABLE {table}") == [(1,)], table
    cluster_in_sync(cluster)
    assert local_versions(s1r1) and local_versions(s1r2) == local_versions(s1r1)


def test_a_migration_with_a_server_down_is_completed_when_it_is_back(
    cluster: LocalClickHouseCluster, tmp_path: Path
) -> None:
    """Tried: s1r2 stopped, then two new migrations (from temporary folders beside the shipped
    ones) run from s1r1 with a 2 s DDL timeout: a table created, then a column added to the
    dimension. Each ON CLUSTER statement waits its 2 s for s1r2 (not the client's 60 s receive
    timeout, which would blame s1r1 as unreachable) and stays queued for it: the first migration
    fails in one line saying so, and is in the journal (the queue runs it). The second's
    replicas' ALTER is queued so too, but the Distributed table's, server by server, cannot
    reach s1r2: it fails in one line naming s1r2, and is not in the journal. s1r2, started
    again, runs the queue (the table, and its replica's column); the migration run again from
    s1r2 then completes the second (what ran is not run twice: no "column already exists"), its
    replica fetches what its shard holds, and a third run applies nothing."""
    created = with_migration(tmp_path / "created", "0899_probe", PROBE_TABLE)
    migrations = with_migration(tmp_path / "migrations", "0899_probe", PROBE_TABLE)
    (migrations / "0900_layout_group_note.sql").write_text(ADD_NOTE)
    s1r1, s1r2 = cluster.node("s1r1"), cluster.node("s1r2")
    with open_clickhouse(s1r1.url) as ch:
        insert_events(ch, [parse_event(json.dumps(Group().event(1)).encode()) for _ in range(10)])
    cluster_in_sync(cluster)
    s1r2.down()

    message = failed_migration(s1r1, cluster.name, created)
    assert message.startswith(
        f"2 ON CLUSTER statement(s) did not run on every server of {cluster.name} within 2 s; "
        "they stay queued in ZooKeeper"
    ), message
    assert "Code: 159." in message and "distributed_ddl_task_timeout (=2)" in message
    with open_clickhouse(s1r1.url) as ch:
        assert "0899_probe" in journal(ch)

    message = failed_migration(s1r1, cluster.name, migrations)
    assert message.startswith(
        f"ClickHouse migration 0900_layout_group_note did not reach {s1r2.address.host}:"
        f"{s1r2.address.port} "
    ), message
    assert "it is not in the journal" in message and "unreachable" in message
    with open_clickhouse(s1r1.url) as ch:
        assert "0900_layout_group_note" not in journal(ch)
        assert note_columns(ch) == 2

    s1r2.up()
    with open_clickhouse(s1r2.url) as ch:
        # The queued CREATE, and the column: the replica may take the column from its shard's
        # replication log before its DDL worker runs the queue (a CI run saw it so).
        wait_until(
            lambda: (
                ch.rows("EXISTS TABLE pin_dev_stats.probe_local") == [(1,)]
                and note_columns(ch) >= 1
            ),
            timeout=60,
            what="s1r2 running the queue",
        )
        assert migrate_clickhouse(ch, cluster.name, migrations=migrations) == [
            "0900_layout_group_note"
        ]
        assert note_columns(ch) == 2
    cluster_in_sync(cluster)
    assert local_versions(s1r1) and local_versions(s1r2) == local_versions(s1r1)
    with open_clickhouse(s1r2.url) as ch:
        assert migrate_clickhouse(ch, cluster.name, migrations=migrations) == []


def failed_migration(node: ClusterNode, cluster: str, migrations: Path) -> str:
    """The one-line error of the migrations of `migrations` run from `node` with a 2 s DDL
    timeout, which must come within 30 s."""
    started = time.monotonic()
    with open_clickhouse(node.url) as ch, pytest.raises(PinError) as caught:
        migrate_clickhouse(ch, cluster, ddl_timeout=2, migrations=migrations)
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def note_columns(ch: ClickHouse) -> int:
    """How many of the server's dimension tables (local, Distributed) have the Note column."""
    [(found,)] = ch.rows(
        "SELECT count() FROM system.columns WHERE database = 'pin_dev_stats' "
        "AND table IN ('dim_layout_group', 'dim_layout_group_local') AND name = 'Note'"
    )
    return int(found)


def test_a_column_is_added_on_the_cluster_while_the_loader_writes(
    cluster: LocalClickHouseCluster,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a continuous `pin devstats load` process (PIN_CLICKHOUSE_CLUSTER set) writing
    300 groups' versions 1–10 through the Distributed table in three waves, and a new migration
    (a column with a default) applied ON CLUSTER while the second wave loads. Every group ends
    at version 10 and nothing is dead-lettered; every table of every server has the column, and
    every row read through the Distributed table its default."""
    migrations = with_migration(tmp_path / "migrations", "0901_layout_group_label", ADD_LABEL)
    url = cluster.url()
    env = {
        **loader_env(url, kafka_bootstrap, pg_dsn, tmp_path),
        "PIN_CLICKHOUSE_CLUSTER": cluster.name,
    }

    def labelled(ch: ClickHouse) -> tuple[int, int]:
        [(rows, labelled)] = ch.rows(f"SELECT count(), countIf(Label = 'none') FROM {TABLE}")
        return int(rows), int(labelled)

    report = migrate_while_loading(
        url, cluster.name, migrations, loader_options, env, kafka_bootstrap, tmp_path, labelled
    )
    assert report["applied"] == ["0901_layout_group_label"]
    assert report["consumed"] == 3000 and report["dead_lettered"] == 0
    rows, labelled_rows = report["inspected"]
    assert rows >= 300 and labelled_rows == rows
    for node in cluster.nodes:
        with open_clickhouse(node.url) as ch:
            [(found,)] = ch.rows(
                "SELECT count() FROM system.columns WHERE database = 'pin_dev_stats' "
                "AND table IN ('dim_layout_group', 'dim_layout_group_local') AND name = 'Label'"
            )
        assert found == 2, node.replica.name


#: A table as a later release would create it (its cluster form: two ON CLUSTER statements).
PROBE_TABLE = """CREATE TABLE IF NOT EXISTS pin_dev_stats.probe (Id UInt8, Seen DateTime)
ENGINE = ReplacingMergeTree(Seen) ORDER BY (Id);
"""

#: A column with a default, as a later release would add it (a second one: the module's cluster
#: has the note already).
ADD_LABEL = "ALTER TABLE pin_dev_stats.dim_layout_group ADD COLUMN Label String DEFAULT 'none';\n"


def test_every_version_of_a_group_lives_on_one_shard(
    clickhouse_cluster: LocalClickHouseCluster,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Tried: 40 groups, versions 1-3 each loaded in separate batches through s2r1. Each group's
    rows are on one shard only (both shards hold some), shard 1's replicas agree, and the argMax
    read gives version 3 from every server."""
    history = [Group() for _ in range(40)]
    settings = settings_for(clickhouse_cluster.url("s2r1"), kafka_bootstrap, tmp_path)
    for version in (1, 2, 3):
        produce_events(kafka_bootstrap, loader_options.topic, [g.event(version) for g in history])
        assert load_once(settings, loader_options).inserted == 40
    cluster_in_sync(clickhouse_cluster)

    ids = {g.id for g in history}
    shard_of: dict[uuid.UUID, set[int]] = {}
    for node in (clickhouse_cluster.node("s1r1"), clickhouse_cluster.node("s2r1")):
        for gid in local_versions(node).keys() & ids:
            shard_of.setdefault(gid, set()).add(node.replica.shard)
    assert shard_of.keys() == ids
    assert all(len(shards) == 1 for shards in shard_of.values())
    assert {next(iter(s)) for s in shard_of.values()} == {1, 2}
    assert local_versions(clickhouse_cluster.node("s1r1")) == local_versions(
        clickhouse_cluster.node("s1r2")
    )
    for node in clickhouse_cluster.nodes:
        assert current_versions(node.url, sorted(ids)) == dict.fromkeys(ids, 3)
        with open_clickhouse(node.url) as ch:  # the guard: ids as an external table, every shard
            assert stored_versions(ch, ids) == {gid.int: 3 for gid in ids}


def test_a_batch_sent_again_is_stored_once(
    clickhouse_cluster: LocalClickHouseCluster, clickhouse_cluster_url: str
) -> None:
    """Tried: the same batch of 50 events (both shards) inserted twice through the Distributed
    table, as a retry does when the guard could not see the first insert land. 18.16 has no
    insert_deduplication_token: each shard's replicated table recognises the identical block by
    its hash and stores it once, on every replica."""
    history = [Group() for _ in range(50)]
    events = [parse_event(json.dumps(g.event(1)).encode()) for g in history]
    duplicates_before = duplicated_blocks(clickhouse_cluster)
    with open_clickhouse(clickhouse_cluster_url) as ch:
        assert not ch.deduplicates_inserts  # no token on 18.16: the block hash alone
        for _ in range(2):
            insert_events(ch, events)
            ch.confirm_insert()
    # One block per shard was recognised (not merged away later, which would also leave one row).
    assert duplicated_blocks(clickhouse_cluster) - duplicates_before == 2
    cluster_in_sync(clickhouse_cluster)
    for node in clickhouse_cluster.nodes:
        with open_clickhouse(node.url) as ch:
            stored = [physical_rows(ch, g.id) for g in history]
        assert stored == [[(1, "Студии v1")]] * 50, node.replica.name


# --- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", [load_once, load_continuously], ids=["once", "continuous"])
def test_kill_9_of_a_replica_while_the_loader_runs_loses_no_event(
    cluster: LocalClickHouseCluster,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
    loader: Callable[[Settings, LoadOptions], LoadSummary],
) -> None:
    """Tried: 9,000 events (300 groups × 30 versions) loaded through s2r1 in batches of 100, by a
    bounded cycle (`pin devstats load --once`) and by the continuous loader of the long-lived
    load runs (`pin devstats load`, stopped once its offsets reach the topic's end); the replica
    of shard 1 that takes the loader's inserts (s1r1 by remote_servers order, unless s2r1 still
    avoids it after an earlier failure) gets SIGKILL as soon as the first insert reaches it, and
    is started again a second later, while the loader runs. The interrupted insert is retried
    and the inserts go on on the other replica (a run that runs out of retries is followed by
    another, as the sensor does); the runs end with every offset committed. Once the killed
    replica is back and caught up, both replicas hold the same rows and every server reads the
    newest version of every group: no event lost."""
    history = [Group() for _ in range(300)]
    produce_events(
        kafka_bootstrap,
        loader_options.topic,
        [g.event(v) for v in range(1, 31) for g in history],
    )
    settings = settings_for(cluster.url("s2r1"), kafka_bootstrap, tmp_path)
    options = replace(loader_options, batch_size=100, attempts=5, backoff_seconds=0.5)
    stop = threading.Event()  # the continuous loader's SIGTERM
    shard_1 = [cluster.node("s1r1"), cluster.node("s1r2")]
    inserts_before = {node.replica.name: insert_queries(node) for node in shard_1}
    outcome: list[LoadSummary | Exception] = []
    finished = threading.Event()

    def load() -> None:
        try:
            outcome.append(loader(settings, replace(options, should_stop=stop.is_set)))
        except Exception as exc:  # handed to the test's thread
            outcome.append(exc)
        finally:
            finished.set()

    def all_committed() -> bool:
        ends = end_offsets(kafka_bootstrap, options.topic)
        return committed(kafka_bootstrap, options.topic, options.group) == ends

    loading = threading.Thread(target=load)
    loading.start()
    try:
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            taking = [n for n in shard_1 if insert_queries(n) > inserts_before[n.replica.name]]
            victim = taking[0] if taking else None
        assert victim is not None, "no insert reached shard 1"
        kill_9(victim.pidfile)
        assert not finished.is_set(), "the loader ended before the kill: make the load longer"
        time.sleep(1.0)
        victim.up()
        # A continuous load runs on: until it has committed the whole topic, or failed.
        wait_until(lambda: finished.is_set() or all_committed(), timeout=120, what="the load")
    finally:
        stop.set()
        loading.join(timeout=300)
    assert not loading.is_alive()
    [first_run] = outcome
    if isinstance(first_run, Exception):  # the outage outlasted its retries: the next run goes on
        assert isinstance(first_run, ClickHouseUnavailable), first_run
    load_until_done(settings, options)
    [survivor] = [node for node in shard_1 if node is not victim]
    assert insert_queries(survivor) > inserts_before[survivor.replica.name]

    cluster_in_sync(cluster)
    ids = sorted(g.id for g in history)
    assert local_versions(shard_1[0]) == local_versions(shard_1[1])
    for node in cluster.nodes:
        assert current_versions(node.url, ids) == dict.fromkeys(ids, 30)
    ends = end_offsets(kafka_bootstrap, options.topic)
    assert committed(kafka_bootstrap, options.topic, options.group) == ends


@pytest.mark.parametrize("loader", [load_once, load_continuously], ids=["once", "continuous"])
def test_a_whole_shard_down_fails_the_load_in_one_line_and_commits_nothing_unstored(
    cluster: LocalClickHouseCluster,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
    loader: Callable[[Settings, LoadOptions], LoadSummary],
) -> None:
    """Tried: shard 2's only server (s2r1) killed with -9, then a batch of 20 groups (both
    shards) loaded through s1r1, by a bounded cycle and by the continuous loader of the
    long-lived load runs (which would stop on its own only after a minute: it must not wait for
    that). The load fails after its retries with one line naming the unreachable server, and
    the committed offsets stay where the stored events end. With s2r1 back, the next run loads
    the batch, each version stored once."""
    settings = settings_for(cluster.url("s1r1"), kafka_bootstrap, tmp_path)
    early = [Group() for _ in range(2)]
    produce_events(kafka_bootstrap, loader_options.topic, [g.event(1) for g in early])
    assert load_once(settings, loader_options).inserted == 2
    before = committed(kafka_bootstrap, loader_options.topic, loader_options.group)

    kill_9(cluster.node("s2r1").pidfile)
    batch = [Group() for _ in range(20)]
    produce_events(kafka_bootstrap, loader_options.topic, [g.event(2) for g in batch])
    give_up = time.monotonic() + 60
    with pytest.raises(ClickHouseUnavailable) as caught:
        loader(settings, replace(loader_options, should_stop=lambda: time.monotonic() > give_up))
    assert time.monotonic() < give_up
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"ClickHouse server at {cluster.node('s1r1').address}: Code: 279. ")
    assert f"Connection refused ({cluster.node('s2r1').address})" in message
    assert "gave up after 3 attempts" in message and "offsets are not committed" in message
    assert committed(kafka_bootstrap, loader_options.topic, loader_options.group) == before

    cluster.node("s2r1").up()
    summary = load_once(settings, loader_options)
    assert (summary.consumed, summary.inserted) == (20, 20)
    cluster_in_sync(cluster)
    ids = sorted(g.id for g in early + batch)
    assert current_versions(settings.clickhouse_url, ids) == {
        **{g.id: 1 for g in early},
        **{g.id: 2 for g in batch},
    }
    with open_clickhouse(settings.clickhouse_url) as ch:
        assert [physical_rows(ch, g.id) for g in batch] == [[(2, "Студии v2")]] * 20


def test_zookeeper_down_fails_inserts_and_reads_go_on(
    cluster: LocalClickHouseCluster,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Tried: ZooKeeper killed with -9 after a group was loaded. Its next version cannot be
    stored (the replicated tables are read-only without ZooKeeper): the load fails in one line
    and commits nothing, while the dimension still answers labels through the Distributed table.
    With ZooKeeper back, the next run stores the version."""
    settings = settings_for(cluster.url("s1r1"), kafka_bootstrap, tmp_path)
    group = Group()
    produce_events(kafka_bootstrap, loader_options.topic, [group.event(1)])
    assert load_once(settings, loader_options).inserted == 1
    before = committed(kafka_bootstrap, loader_options.topic, loader_options.group)

    kill_9(cluster.zookeeper.pidfile)
    produce_events(kafka_bootstrap, loader_options.topic, [group.event(2)])
    with pytest.raises(ClickHouseUnavailable) as caught:
        load_once(settings, loader_options)
    message = str(caught.value)  # read-only tables (242), or the session's expiry seen first (225)
    assert "\n" not in message and ("Code: 242. " in message or "Code: 225. " in message), message
    assert committed(kafka_bootstrap, loader_options.topic, loader_options.group) == before
    with open_clickhouse(settings.clickhouse_url) as ch:
        assert labels(ch, group.developer_id, [group.id]) == {str(group.id): "Студии v1"}

    cluster.zookeeper.up()
    cluster_in_sync(cluster)
    assert load_once(settings, loader_options).inserted == 1
    assert current_versions(settings.clickhouse_url, [group.id]) == {group.id: 2}


def test_pin_stack_down_stops_zookeeper_and_every_server_and_status_forgets_them(
    cluster: LocalClickHouseCluster, tmp_path: Path
) -> None:
    """Tried: `pin stack down` without a flag, on the state folder of the module's cluster (the
    stack's own cluster is shared, so no test stops it; down finds a cluster by its pid files,
    whatever its ports). It reports the three servers by shard and replica and ZooKeeper as
    stopped, their processes are gone and their ports closed, and `pin stack status` then lists
    none of them. The fixture starts them again."""
    env = {
        "PIN_STATE_DIR": str(cluster.root.parent),
        "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",  # no server of its own to stop
        "PIN_CLICKHOUSE_CLUSTER": "",
    }
    pids = [read_pid(cluster.zookeeper.pidfile), *(read_pid(n.pidfile) for n in cluster.nodes)]
    assert None not in pids
    down = summary(run_pin("stack", "down", env=env))["services"]
    assert [
        (s["service"], s.get("shard"), s.get("replica"), s["state"])
        for s in down
        if s["service"] in ("zookeeper", "clickhouse-cluster")
    ] == [
        ("clickhouse-cluster", 1, "s1r1", "stopped"),
        ("clickhouse-cluster", 1, "s1r2", "stopped"),
        ("clickhouse-cluster", 2, "s2r1", "stopped"),
        ("zookeeper", None, None, "stopped"),
    ]
    assert not any(pid_alive(pid) for pid in pids if pid is not None)
    ports = [cluster.zookeeper.port, *(n.address.port for n in cluster.nodes)]
    assert [port for port in ports if port_open("127.0.0.1", port)] == []
    status = summary(run_pin("stack", "status", env=env))["services"]
    assert [s for s in status if s["service"] in ("zookeeper", "clickhouse-cluster")] == []


def test_a_replica_whose_only_part_zookeeper_never_registered_starts_and_catches_up(
    cluster: LocalClickHouseCluster, empty_cluster_dimension: ClickHouse
) -> None:
    """Tried: what a kill -9 between an insert's part write and its registration in ZooKeeper
    leaves (CI saw it in the kill -9 test above): shard 1 holds one part of 10 groups; s1r2 is
    stopped and its part renamed to block numbers ZooKeeper never allocated, so at its start
    every row on its disk is in a part ZooKeeper does not know. With ClickHouse's default
    `replicated_max_ratio_of_wrong_parts` (0.5) it refused to start ("doesn't look like the set
    of parts in ZooKeeper"); the local cluster's setting lets it detach the part and start, and
    it fetches the registered part from s1r1: both replicas hold the 10 groups."""
    s1r1, s1r2 = cluster.node("s1r1"), cluster.node("s1r2")
    history = [Group() for _ in range(10)]
    with open_clickhouse(s1r1.url) as ch:
        ch.insert(
            LOCAL,
            COLUMNS,
            [parse_event(json.dumps(g.event(1)).encode()).row() for g in history],
        )
    cluster_in_sync(cluster)
    assert local_versions(s1r2) == {g.id: 1 for g in history}
    database, table = LOCAL.split(".")
    with open_clickhouse(s1r2.url) as ch:
        [(name,)] = ch.rows(
            "SELECT name FROM system.parts WHERE database = %(db)s AND table = %(t)s AND active",
            {"db": database, "t": table},
        )
    partition, low, high, level = str(name).rsplit("_", 3)
    unregistered = f"{partition}_{int(low) + 1000}_{int(high) + 1000}_{level}"
    parts = s1r2.root / "data" / "data" / database / table
    s1r2.down()
    (parts / str(name)).rename(parts / unregistered)

    s1r2.up()  # the fixture would start it again too; here it must start by itself
    cluster_in_sync(cluster)
    detached = [p.name for p in (parts / "detached").iterdir()]
    assert [p for p in detached if p.endswith(unregistered)] != [], detached
    assert local_versions(s1r2) == local_versions(s1r1) == {g.id: 1 for g in history}


# --- reconciliation on the Distributed table ---------------------------------------------------


@pytest.fixture
def settings(
    pg_dsn: str, cluster: LocalClickHouseCluster, kafka_bootstrap: str, tmp_path: Path
) -> Settings:
    """The pipeline fixture's settings (tests/integration/conftest.py), on the module's cluster."""
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_CLICKHOUSE_URL": cluster.url(),
            "PIN_CLICKHOUSE_CLUSTER": cluster.name,
            "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "PIN_STATE_DIR": str(tmp_path),
        }
    )


@pytest.fixture
def empty_cluster_dimension(cluster: LocalClickHouseCluster) -> Iterator[ClickHouse]:
    """Other tests' groups are not this test's drift: every shard's table emptied (the module's
    cluster: on the stack's, other sessions' groups would vanish under their tests)."""
    with open_clickhouse(cluster.url()) as ch:
        ch.command(f"TRUNCATE TABLE {LOCAL} ON CLUSTER {cluster.name}")
        yield ch


def test_drift_asset_and_versions_check_work_on_the_distributed_table(
    db: psycopg.Connection,
    settings: Settings,
    empty_cluster_dimension: ClickHouse,
    pipeline: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: a project's groups loaded into the cluster through drain → relay → loader, then a
    rename whose event was lost and a row behind its source past the SLA. The drift asset and
    the versions check, run by Dagster with the cluster's settings, read the Distributed table:
    clean after the load, the drifted groups found, clean again after the repair's events load."""
    ch = empty_cluster_dimension
    ids = small_project(db)
    pipeline()
    reconcile(settings, repair=True)  # the groups' first publication (no layouts changed since)
    pipeline()
    assert dim_layout_group_drift(settings.pg_dsn, ch).kinds == {}

    db.execute("UPDATE chessboard.layout_groups SET name = 'Renamed' WHERE id = %s", (ids["lux"],))
    db.execute(
        "UPDATE chessboard.layout_groups SET version = version + 1,"
        " updated_at = now() - interval '10 minutes' WHERE id = %s",
        (ids["studios"],),
    )
    assert dim_layout_group_drift(settings.pg_dsn, ch).kinds == {
        ids["lux"]: "different",
        ids["studios"]: "stale_version",
    }

    monkeypatch.setenv("PIN_CLICKHOUSE_URL", settings.clickhouse_url)
    monkeypatch.setenv("PIN_CLICKHOUSE_CLUSTER", "pin")
    drifted = dg.materialize([drift_asset], resources=RESOURCES, raise_on_error=False)
    [in_sync] = drifted.get_asset_check_evaluations()
    assert not in_sync.passed and in_sync.metadata["dim_rows_drifted"].value == 2
    versions_job = defs.resolve_job_def(
        defs.resolve_schedule_def("dim_layout_group_versions_schedule").job_name
    )
    with dg.DagsterInstance.ephemeral() as instance:
        [check] = versions_job.execute_in_process(instance=instance).get_asset_check_evaluations()
        assert not check.passed
        assert check.metadata["behind_past_sla_ids"].value == [str(ids["studios"])]

        repaired = dg.materialize(
            [drift_asset],
            resources=RESOURCES,
            run_config={"ops": {"dim_layout_group_drift": {"config": {"repair": True}}}},
            raise_on_error=False,
        )
        assert repaired.success
        pipeline()
        [check] = versions_job.execute_in_process(instance=instance).get_asset_check_evaluations()
        assert check.passed
    [clean] = dg.materialize([drift_asset], resources=RESOURCES).get_asset_check_evaluations()
    assert clean.passed and clean.metadata["dim_rows_drifted"].value == 0
