"""Kafka as a production cluster (issue 16), on a private 3-node KRaft cluster of this module:
replicated topics and the migrate check, the relay and the loaders across a broker killed with
SIGKILL, two loaders splitting the partitions through a rebalance.

The cluster is this module's own (never the shared broker on 9092): started once (~20 s on two
cores), every node stopped and reaped at the end. Nodes killed by a test are started again by it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import (
    ALL_TOPICS,
    TOPIC_LAYOUT_GROUP,
    TOPIC_RELAY_COMMITS,
    TopicPolicy,
    admin,
    check_topics,
    ensure_topics,
)
from pin_pipelines.migrate import migrate_all
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.process import free_port, read_pid, wait_until
from tests.integration.test_outbox_relay import TOPICS, outbox_count
from tests.integration.test_relay_exactly_once import assert_exactly_once_in_order, backlog
from tests.support.cli import PIN

NODES = 3
#: The loaders' dimension: the test stack's ClickHouse server (groups of random ids).
CLICKHOUSE_URL = "clickhouse://default@127.0.0.1:9000/pin_dev_stats"


def _free_run(length: int) -> int:
    """A loopback port starting `length` free consecutive ports (brokers and controllers)."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + length):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafkaCluster]:
    root = tmp_path_factory.mktemp("kafka-cluster")
    nodes = LocalKafkaCluster(
        Settings.from_env(
            {"PIN_STATE_DIR": str(root), "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{_free_run(6)}"}
        ),
        NODES,
    )
    shared_jars = LocalKafka(Settings.from_env()).libs
    nodes.root.mkdir(parents=True)
    if shared_jars.exists():
        nodes.libs.symlink_to(shared_jars)
    try:
        nodes.up()
        ensure_topics(nodes.bootstrap, ALL_TOPICS, TopicPolicy())
        yield nodes
    finally:
        pids = [read_pid(node.pidfile) for node in nodes.nodes]
        nodes.down()
        for pid in pids:
            _reap(pid)


def _reap(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def leader(bootstrap: str, topic: str, partition: int) -> int:
    return int(
        admin(bootstrap).list_topics(topic, timeout=10).topics[topic].partitions[partition].leader
    )


def kill_node(cluster: LocalKafkaCluster, node_id: int) -> None:
    """SIGKILL: no controlled shutdown, no leadership handed over."""
    node = cluster.nodes[node_id - 1]
    pid = read_pid(node.pidfile)
    assert pid is not None, f"node {node_id} is not running"
    os.kill(pid, signal.SIGKILL)
    _reap(pid)


def restore(cluster: LocalKafkaCluster) -> None:
    """Start the killed node again and wait until every partition has its 3 replicas in sync."""
    cluster.up()

    def in_sync() -> bool:
        topics = admin(cluster.bootstrap).list_topics(timeout=5).topics
        return all(len(p.isrs) == NODES for t in ALL_TOPICS for p in topics[t].partitions.values())

    wait_until(in_sync, timeout=90, what="the replicas back in sync")


@pytest.fixture
def settings(cluster: LocalKafkaCluster, pg_dsn: str, tmp_path: os.PathLike[str]) -> Settings:
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_KAFKA_BOOTSTRAP": cluster.bootstrap,
            "PIN_CLICKHOUSE_URL": CLICKHOUSE_URL,
            "PIN_STATE_DIR": str(tmp_path),
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-kcluster-{uuid.uuid4().hex[:8]}",
        }
    )


def env_of(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "PIN_PG_DSN": settings.pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "PIN_CLICKHOUSE_URL": settings.clickhouse_url,
        "PIN_STATE_DIR": str(settings.state_dir),
        "PIN_RELAY_TRANSACTIONAL_ID": settings.relay_transactional_id,
        "PIN_DEVSTATS_MAX_LOAD_RUNS": "2",
    }


def test_topics_are_replicated_and_migrate_refuses_weaker_ones(
    cluster: LocalKafkaCluster, settings: Settings
) -> None:
    """Tried: the topics `pin db migrate` makes on 3 brokers with the default settings (6
    partitions, RF 3, min.insync.replicas 2; the receipts 1 partition, replicated), then the
    migration with PIN_KAFKA_PARTITIONS=12: it fails naming the weaker topics, passes with
    allow_weaker_topics reporting them, and leaves every topic as it was (never grown, shrunk or
    recreated)."""
    # Each broker learns of new topics on its own: the one answering may be a moment behind.
    client = admin(cluster.bootstrap)
    wait_until(
        lambda: set(ALL_TOPICS) <= set(client.list_topics(timeout=10).topics),
        timeout=30,
        what="every broker's metadata to list the topics",
    )
    metadata = client.list_topics(timeout=10)
    for topic in ALL_TOPICS:
        partitions = metadata.topics[topic].partitions
        assert len(partitions) == (1 if topic == TOPIC_RELAY_COMMITS else 6), topic
        assert {len(p.replicas) for p in partitions.values()} == {3}, topic
    assert check_topics(cluster.bootstrap, ALL_TOPICS, TopicPolicy()) == []

    stronger = Settings.from_env({**env_of(settings), "PIN_KAFKA_PARTITIONS": "12"})
    with pytest.raises(PinError, match=r"layout-group-upserted\.v1: partitions 6 < 12"):
        migrate_all(stronger)
    summary = migrate_all(stronger, allow_weaker_topics=True)
    assert len(summary["kafka_topics_weaker"]) == 4  # type: ignore[arg-type]
    assert "min.insync.replicas" not in str(summary["kafka_topics_weaker"])
    after = admin(cluster.bootstrap).list_topics(timeout=10).topics
    assert len(after[TOPIC_LAYOUT_GROUP].partitions) == 6


def test_relay_with_the_leader_killed_mid_run_loses_and_reorders_nothing(
    cluster: LocalKafkaCluster, settings: Settings, outbox: psycopg.Connection
) -> None:
    """Tried: `pin outbox relay --once` publishing 3,000 events (300 keys × versions 1..10) on RF 3
    / acks=all; once the first events are in Kafka, the leader of layout-group partition 0 is
    SIGKILLed and the cluster elects another. Runs again while it reports a failure. Then every
    outbox event is in Kafka exactly once for read_committed readers, per key in Version order,
    and the outbox holds nothing (only acknowledged transactions are deleted)."""
    start = end_offsets(cluster.bootstrap, TOPICS)
    events = backlog(outbox, keys=300, versions=10)
    victim = leader(cluster.bootstrap, TOPIC_LAYOUT_GROUP, 0)
    relay = subprocess.Popen(
        # Transactions of 200 events: the kill lands while the relay is between the first
        # committed one and the last.
        [PIN, "outbox", "relay", "--once", "--batch-size", "200"],
        env=env_of(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: outbox_count(outbox) < 3000 or relay.poll() is not None,
            timeout=60,
            what="the relay's first transaction",
        )
        assert relay.poll() is None, "the relay finished before the kill"
        killed_at = time.monotonic()
        kill_node(cluster, victim)
        _, err = relay.communicate(timeout=120)
        wait_until(
            lambda: leader(cluster.bootstrap, TOPIC_LAYOUT_GROUP, 0) not in (victim, -1),
            timeout=60,
            what="a new leader for the killed one's partition",
        )
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait(timeout=30)
    attempts = [relay.returncode]
    while outbox_count(outbox) and len(attempts) < 4:
        rerun = subprocess.run(
            [PIN, "outbox", "relay", "--once"],
            env=env_of(settings),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        attempts.append(rerun.returncode)
        err = rerun.stderr
    assert outbox_count(outbox) == 0, f"relay runs {attempts}, last stderr: {err[-400:]}"
    print(f"leader {victim} killed; all relayed {time.monotonic() - killed_at:.1f}s later")
    assert_exactly_once_in_order(cluster.bootstrap, start, events)
    restore(cluster)
