"""A private 3-node KRaft cluster of the test session, for the modules that run Kafka as a
production cluster (test_kafka_cluster.py, test_kafka_partitions.py): never the shared broker on
9092, since their tests kill nodes (SIGKILL) or cut them off.

It starts once per session (per xdist worker; ~20 s on two cores) with the jars `pin stack up`
already fetched, and every node is killed at the session's end. Each module that takes `cluster`
gets it reset to the state of a new cluster: every node up, no topic but the project's (empty,
replicated with the default TopicPolicy), no consumer group, every partition's replicas in sync
and led by its preferred one. Nodes killed by a test are started again by it (`restore`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import ElectionType, KafkaException

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import ALL_TOPICS, TopicPolicy, admin
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.process import free_port_run, read_pid, wait_until
from tests.support.cli import PIN
from tests.support.private_kafka import empty_kafka, link_shared_jars

NODES = 3
#: The loaders' dimension: the test stack's ClickHouse server (groups of random ids).
CLICKHOUSE_URL = "clickhouse://default@127.0.0.1:9000/pin_dev_stats"


@pytest.fixture(scope="session")
def private_kafka_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalKafkaCluster]:
    """The session's private cluster, started on first use and killed at the session's end."""
    root = tmp_path_factory.mktemp("kafka-cluster")
    nodes = LocalKafkaCluster(
        Settings.from_env(
            {"PIN_STATE_DIR": str(root), "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port_run(6)}"}
        ),
        NODES,
    )
    link_shared_jars(nodes.libs)
    try:
        nodes.up()
        yield nodes
    finally:
        # SIGKILL, not `down`: the data is thrown away, and the last node of a quorum waits out
        # its 30 s grace before it gives up a controlled shutdown.
        for node_id in range(1, NODES + 1):
            kill_node(nodes, node_id)


@pytest.fixture(scope="module")
def cluster(private_kafka_cluster: LocalKafkaCluster) -> LocalKafkaCluster:
    """The private cluster as a new one: every node up, the project's topics empty, no group."""
    reset_cluster(private_kafka_cluster)
    return private_kafka_cluster


def reset_cluster(cluster: LocalKafkaCluster) -> None:
    """Every node up (a no-op for those that run) and registered, every topic but Kafka's own
    deleted and every consumer group with it, then the project's topics created again (the
    default TopicPolicy: replicated), each partition with its leader, its replicas in sync and
    led by its preferred one (`restore`)."""
    cluster.up()
    bootstrap = cluster.bootstrap
    empty_kafka(bootstrap, TopicPolicy())
    wait_until(
        lambda: answers_offsets(bootstrap),
        timeout=60,
        what="a leader for every partition of the new topics",
    )
    restore(cluster)


def answers_offsets(bootstrap: str) -> bool:
    try:
        end_offsets(bootstrap, list(ALL_TOPICS))
    except PinError:
        return False
    return True


def _reap(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def leader(bootstrap: str, topic: str, partition: int) -> int:
    return int(
        admin(bootstrap).list_topics(topic, timeout=10).topics[topic].partitions[partition].leader
    )


def kill_node(cluster: LocalKafkaCluster, node_id: int) -> None:
    """SIGKILL: no controlled shutdown, no leadership handed over (a no-op on a dead node)."""
    pid = read_pid(cluster.nodes[node_id - 1].pidfile)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        _reap(pid)


def restore(cluster: LocalKafkaCluster) -> None:
    """Start the killed nodes again, wait until every partition has its 3 replicas in sync, and
    give the preferred replicas their leadership back (the broker does it only every 5 minutes):
    each test then meets a cluster whose every node leads partitions."""
    cluster.up()

    def in_sync() -> bool:
        topics = admin(cluster.bootstrap).list_topics(timeout=5).topics
        # Topics just created (`reset_cluster`) may not be listed yet by the broker answering.
        return set(ALL_TOPICS) <= set(topics) and all(
            len(p.isrs) == NODES for t in ALL_TOPICS for p in topics[t].partitions.values()
        )

    wait_until(in_sync, timeout=90, what="the replicas back in sync")
    client = admin(cluster.bootstrap)
    with contextlib.suppress(KafkaException):  # every partition led by its preferred one
        client.elect_leaders(ElectionType.PREFERRED, None).result(timeout=30)
    wait_until(lambda: answers_offsets(cluster.bootstrap), timeout=60, what="the new leaders")


def cluster_settings(
    cluster: LocalKafkaCluster, pg_dsn: str, state_dir: os.PathLike[str]
) -> Settings:
    """The settings of the `pin` processes of a test on the cluster: the test database, the
    server dimension (CLICKHOUSE_URL), a state folder and a transactional.id of the test's own."""
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_KAFKA_BOOTSTRAP": cluster.bootstrap,
            "PIN_CLICKHOUSE_URL": CLICKHOUSE_URL,
            "PIN_STATE_DIR": str(state_dir),
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


def continuous_load(settings: Settings) -> subprocess.Popen[str]:
    """`pin devstats load`: a continuous loader of the group, until SIGTERM."""
    return subprocess.Popen(
        [PIN, "devstats", "load"], env=env_of(settings),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
