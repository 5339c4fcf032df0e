"""ClickHouse fixtures (every path) and per-test Kafka topics for the dev-stats loader.

Registered for every test by `pytest_plugins` in tests/conftest.py: a fixture starts nothing until
a test asks for it, so tests/unit runs with no service up. A missing service FAILS the test:
- the embedded engine: one chdb folder per test session, held open for the whole session (chdb
  serves one folder per process, so every in-process chdb user must take `chdb_url`);
- the server: `PIN_TEST_CLICKHOUSE_SERVER_URL` (default the `pin stack up` server on port 9000);
- the cluster: the local cluster of `pin stack up --clickhouse-cluster` (cluster `pin`, under the
  state folder), started here when it is not running, migrated ON CLUSTER; its clients talk to
  the server of shard 1's first replica.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import (
    ClickHouse,
    ClickHouseError,
    ClickHouseUnavailable,
    ServerAddress,
    migrate_clickhouse,
    open_clickhouse,
)
from pin_pipelines.clickhouse.cluster import LOCAL_SUFFIX
from pin_pipelines.clickhouse.server import ServerClickHouse
from pin_pipelines.clickhouse.url import DATABASE
from pin_pipelines.config import Settings
from pin_pipelines.devstats.dim import TABLE
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import delete_topics, ensure_topics
from pin_pipelines.stack.clickhouse_cluster import DEFAULT_CLUSTER, LocalClickHouseCluster
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import free_port
from tests.support.cli import run_pin, summary

SERVER_URL = os.environ.get(
    "PIN_TEST_CLICKHOUSE_SERVER_URL", "clickhouse://default@127.0.0.1:9000/pin_dev_stats"
)
#: The session fixture of each ClickHouse path, by the name tests are parametrized with.
ENGINES = {
    "embedded": "chdb_url",
    "server": "clickhouse_server_url",
    "cluster": "clickhouse_cluster_url",
}


@pytest.fixture(scope="session")
def chdb_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's embedded engine, migrated; this process holds its folder until the end."""
    url = f"chdb://{tmp_path_factory.mktemp('chdb')}"
    with open_clickhouse(url) as ch:
        migrate_clickhouse(ch)
        yield url


@pytest.fixture(scope="session")
def clickhouse_server_url() -> str:
    """The Debian server of the test stack, migrated."""
    try:
        with open_clickhouse(SERVER_URL) as ch:
            migrate_clickhouse(ch)
    except PinError as exc:
        pytest.fail(f"{exc} (start it with `pin stack up` or set PIN_TEST_CLICKHOUSE_SERVER_URL)")
    return SERVER_URL


@pytest.fixture(scope="session")
def clickhouse_cluster() -> LocalClickHouseCluster:
    """The stack's local cluster, up (a server a test killed and did not bring back is restarted)
    and migrated ON CLUSTER. It is a service like the others: left running for the next run."""
    cluster = LocalClickHouseCluster(DEFAULT_CLUSTER, Settings.from_env().state_dir)
    try:
        cluster.up()
        with open_clickhouse(cluster.url()) as ch:
            migrate_clickhouse(ch, cluster.name)
        cluster_in_sync(cluster)
    except PinError as exc:
        pytest.fail(f"the local ClickHouse cluster: {exc} (`pin stack up --clickhouse-cluster`)")
    return cluster


def cluster_in_sync(cluster: LocalClickHouseCluster, timeout: float = 120.0) -> None:
    """Until the cluster is steady: every server answers and reaches ZooKeeper, the
    distributed DDL queue is served by all (a DDL worker still holding a ZooKeeper session that
    expired fails a task once), and every replica is writable (its own ZooKeeper session again),
    has fetched and merged what its shard's log holds and reports no delay. Right after a
    restart 18.16 reports a replica as delayed for a few seconds, and a Distributed read then
    skips it for another replica of the shard, which may not have fetched what an insert just
    wrote: tests read their own writes only from a steady cluster."""
    deadline = time.monotonic() + timeout
    local = f"{TABLE}{LOCAL_SUFFIX}"

    def until(what: str, done: Callable[[], bool]) -> None:
        while True:
            try:
                if done():
                    return
            except ClickHouseUnavailable:
                pass
            if time.monotonic() > deadline:
                raise PinError(f"the local cluster: {what} within {timeout:.0f}s")
            time.sleep(0.2)

    for node in cluster.nodes:
        until(f"{node.replica.name} not ready", node.ready)
    with open_clickhouse(cluster.url()) as ch:

        def ddl_served() -> bool:
            ch.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE} ON CLUSTER {cluster.name}")
            return True

        until("distributed DDL not served by every server", ddl_served)
    for node in cluster.nodes:
        with ServerClickHouse(node.address) as ch:

            def steady() -> bool:
                """Fails (read-only) until the server has a ZooKeeper session again."""
                ch.command(f"SYSTEM SYNC REPLICA {local}")
                found = ch.rows("SELECT max(is_readonly), max(absolute_delay) FROM system.replicas")
                return found == [(0, 0)]

            until(f"{node.replica.name} read-only or delayed", steady)


@pytest.fixture(scope="session")
def clickhouse_cluster_url(clickhouse_cluster: LocalClickHouseCluster) -> str:
    return clickhouse_cluster.url()


@pytest.fixture
def chdb_folder_url(tmp_path: Path, pg_dsn: str) -> str:
    """A migrated embedded folder of this test (`pin db migrate`, as a user would)."""
    url = f"chdb://{tmp_path / 'chdb'}"
    summary(run_pin("db", "migrate", env={"PIN_CLICKHOUSE_URL": url}))
    return url


def engine_url(request: pytest.FixtureRequest) -> str:
    """The URL of the ClickHouse path `request.param` names (ENGINES)."""
    return str(request.getfixturevalue(ENGINES[request.param]))


@pytest.fixture(params=["embedded", "server"])
def clickhouse_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs on both single-node ClickHouse paths; a module whose tests
    also hold on a cluster overrides it with the three of ENGINES."""
    return engine_url(request)


@pytest.fixture
def clickhouse(clickhouse_url: str) -> Iterator[ClickHouse]:
    with open_clickhouse(clickhouse_url) as ch:
        yield ch


@pytest.fixture
def private_clickhouse_server(tmp_path: Path) -> Iterator[LocalClickHouseServer]:
    """A Debian server of this test alone (its own port and state folder), for stop/start tests."""
    server = LocalClickHouseServer(ServerAddress("127.0.0.1", free_port(), "default", ""), tmp_path)
    server.up()
    try:
        yield server
    finally:
        server.down()


def server_url(server: LocalClickHouseServer) -> str:
    return f"clickhouse://default@127.0.0.1:{server.address.port}/pin_dev_stats"


@pytest.fixture
def loader_options(kafka_bootstrap: str) -> Iterator[LoadOptions]:
    """Fresh source and DLQ topics (3 partitions, deleted afterwards) and consumer group, so tests
    never share offsets. Retries are short: an unreachable ClickHouse fails in about a second."""
    suffix = uuid.uuid4().hex[:10]
    options = LoadOptions(
        topic=f"pin.test.layout-group-upserted.{suffix}",
        dlq_topic=f"pin.test.dlq.{suffix}",
        group=f"pin-test-devstats-{suffix}",
        attempts=3,
        backoff_seconds=0.2,
    )
    ensure_topics(kafka_bootstrap, (options.topic, options.dlq_topic))
    yield options
    delete_topics(kafka_bootstrap, (options.topic, options.dlq_topic))


def settings_for(clickhouse_url: str, kafka_bootstrap: str, state_dir: Path) -> Settings:
    return Settings.from_env(
        {
            "PIN_CLICKHOUSE_URL": clickhouse_url,
            "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "PIN_STATE_DIR": str(state_dir),
        }
    )


@pytest.fixture
def loader_settings(clickhouse_url: str, kafka_bootstrap: str, tmp_path: Path) -> Settings:
    return settings_for(clickhouse_url, kafka_bootstrap, tmp_path)


def optimize_dimension(ch: ClickHouse) -> None:
    """Force the merges the spec talks about ("после merge"). On a cluster, per shard: the
    replicas synced, then OPTIMIZE on the first one until the shard holds one part, merged on
    every replica, so a read through the Distributed table sees merged parts whichever replica
    answers it.

    18.16 fails an OPTIMIZE of a replicated table that could not put a merge in the log (the
    parts are in a background merge already, or nothing is left to merge) with "Unknown log
    entry type: 0" (and so fails OPTIMIZE … ON CLUSTER): the replicas are synced again and the
    parts counted again."""
    shards = cluster_shards(ch)
    if not shards:
        # A background merge holding the parts makes OPTIMIZE a no-op (seen in CI): until merged.
        database, table = TABLE.split(".")
        _merge_to_one_part(ch, database, table, repr(ch))
        return
    database, local = TABLE.split(".")[0], f"{TABLE.split('.')[1]}{LOCAL_SUFFIX}"
    for replicas in shards:
        nodes = [ServerClickHouse(address) for address in replicas]

        def synced(nodes: list[ServerClickHouse] = nodes) -> None:
            for node in nodes:
                node.command(f"SYSTEM SYNC REPLICA {database}.{local}")

        try:
            _merge_to_one_part(nodes[0], database, local, str(replicas[0]), before_count=synced)
        finally:
            for node in nodes:
                node.close()


def _merge_to_one_part(
    ch: ClickHouse,
    database: str,
    table: str,
    where: str,
    before_count: Callable[[], None] = lambda: None,
) -> None:
    """OPTIMIZE … FINAL until the table has one active part (10 tries, 0.2 s apart)."""
    for _ in range(10):
        before_count()
        [(parts,)] = ch.rows(
            "SELECT count() FROM system.parts "
            "WHERE active AND database = %(db)s AND table = %(table)s",
            {"db": database, "table": table},
        )
        if parts <= 1:
            return
        try:
            ch.command(f"OPTIMIZE TABLE {database}.{table} FINAL")
        except ClickHouseError as exc:
            if "Unknown log entry type" not in str(exc):
                raise
        time.sleep(0.2)
    raise AssertionError(f"{where} still has {parts} parts of {database}.{table}")


def cluster_shards(ch: ClickHouse) -> list[list[ServerAddress]]:
    """The replicas of each shard behind the Distributed dimension (user `default`, as the test
    clusters have it), in remote_servers order; [] when the dimension is a single-node table."""
    [(engine,)] = ch.rows(
        "SELECT engine_full FROM system.tables WHERE database = %(db)s AND name = %(name)s",
        dict(zip(("db", "name"), TABLE.split("."), strict=True)),
    )
    cluster = re.match(r"Distributed\((\w+),", str(engine))
    if cluster is None:
        return []
    shards: dict[int, list[ServerAddress]] = {}
    for shard, host, port in ch.rows(
        "SELECT shard_num, host_address, port FROM system.clusters WHERE cluster = %(cluster)s "
        "ORDER BY shard_num, replica_num",
        {"cluster": cluster.group(1)},
    ):
        shards.setdefault(int(shard), []).append(ServerAddress(str(host), int(port), "default", ""))
    return list(shards.values())
