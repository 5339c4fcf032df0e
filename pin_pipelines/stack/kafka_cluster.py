"""`pin stack up --kafka-brokers N`: N KRaft nodes (each broker and controller, one quorum of N
voters) of the same Apache Kafka as the single broker, on loopback, under the state folder.

Node i (0-based) listens on PIN_KAFKA_BOOTSTRAP's port + 2i, its controller on the port after;
clients set PIN_KAFKA_BOOTSTRAP to every node (`bootstrap` in the result) so that losing the
first one does not lose the cluster. Internal topics (offsets, transaction state) are replicated
on 3 nodes with min.insync.replicas 2, as the relay's exactly-once transactions need on a cluster
that loses a broker. The size is recorded, so `pin stack status|down` need no flag.
"""

from __future__ import annotations

import time

from confluent_kafka import KafkaException

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import admin, broker_answers
from pin_pipelines.stack.kafka import KAFKA_VERSION, KafkaNode, fetch_jars, new_cluster_id
from pin_pipelines.stack.process import read_pid, stop_pid, wait_until

#: Three JVMs on a small machine: a third of the single broker's heap each is plenty locally.
CLUSTER_HEAP = "-Xmx384m"


def cluster_config(nodes: int) -> str:
    """Broker settings of an N-node cluster: replicated internal topics, failure noticed fast."""
    rf = min(3, nodes)
    isr = max(1, rf - 1)
    return (
        f"default.replication.factor={rf}\n"
        f"min.insync.replicas={isr}\n"
        "num.partitions=6\n"
        f"offsets.topic.replication.factor={rf}\n"
        "offsets.topic.num.partitions=6\n"
        f"transaction.state.log.replication.factor={rf}\n"
        f"transaction.state.log.min.isr={isr}\n"
        f"share.coordinator.state.topic.replication.factor={rf}\n"
        f"share.coordinator.state.topic.min.isr={isr}\n"
        "unclean.leader.election.enable=false\n"
        # A killed node is fenced after 6 s (default 9) and a dead follower leaves the ISR after
        # 10 s (default 30): acks=all producers stall that long, not half a minute.
        "broker.session.timeout.ms=6000\n"
        "broker.heartbeat.interval.ms=1000\n"
        "replica.lag.time.max.ms=10000\n"
    )


class LocalKafkaCluster:
    def __init__(self, settings: Settings, brokers: int | None = None) -> None:
        self.settings = settings
        self.root = settings.state_dir / "kafka"
        self.libs = self.root / f"libs-{KAFKA_VERSION}"
        self.sizefile = self.root / "cluster-brokers"
        self.brokers = brokers or self.recorded_size() or 0
        _, base = settings.kafka_host_port
        self.nodes = [
            KafkaNode(self.root / f"node-{i + 1}", self.libs, i + 1, base + 2 * i, base + 2 * i + 1)
            for i in range(self.brokers)
        ]

    def recorded_size(self) -> int | None:
        try:
            return int(self.sizefile.read_text().strip())
        except (OSError, ValueError):
            return None

    @property
    def bootstrap(self) -> str:
        return ",".join(node.address for node in self.nodes)

    def is_running(self) -> bool:
        return any(read_pid(node.pidfile) is not None for node in self.nodes)

    def up(self) -> list[dict[str, object]]:
        if self.brokers < 2:
            raise PinError(f"--kafka-brokers must be at least 2 for a cluster, got {self.brokers}")
        recorded = self.recorded_size()
        if recorded not in (None, self.brokers):
            raise PinError(
                f"{self.root} holds a {recorded}-broker cluster: `pin stack down` and remove "
                f"{self.root}/node-* to make a {self.brokers}-broker one"
            )
        started = time.monotonic()
        fetch_jars(self.libs)
        self.root.mkdir(parents=True, exist_ok=True)
        idfile = self.root / "cluster.id"
        if not idfile.exists():
            idfile.write_text(new_cluster_id())
        self.sizefile.write_text(f"{self.brokers}\n")
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        config = cluster_config(self.brokers)
        launched = {
            node.node_id: node.start(
                voters=voters,
                cluster_id=idfile.read_text().strip(),
                config=config,
                heap=CLUSTER_HEAP,
            )
            for node in self.nodes
        }
        for node in self.nodes:
            wait_until(
                lambda node=node: broker_answers(node.address, timeout=1.0),  # type: ignore[misc]
                timeout=120,
                what=f"Kafka node {node.node_id}",
                logfile=node.logfile,
                pid=launched[node.node_id][0],
                output=node.output,
            )
        wait_until(
            lambda: self.registered() >= self.brokers,
            timeout=60,
            what="the Kafka cluster's broker registrations",
        )
        ready = round(time.monotonic() - started, 2)
        return [
            {
                "service": f"kafka-{node.node_id}",
                "state": "started" if launched[node.node_id][1] else "already running",
                "version": KAFKA_VERSION,
                "port": node.port,
                "bootstrap": self.bootstrap,
                "ready_seconds": ready,
            }
            for node in self.nodes
        ]

    def registered(self) -> int:
        """Brokers the cluster's metadata lists (a node answers before it is registered)."""
        try:
            return len(admin(self.bootstrap).list_topics(timeout=2.0).brokers)
        except KafkaException:
            return 0

    def down(self) -> list[dict[str, object]]:
        """Stop every node, the controllers' quorum last-standing node included (SIGTERM, then
        SIGKILL after 30 s: a node that lost its quorum may not finish a controlled shutdown)."""
        for node in self.nodes:
            stop_pid(node.pidfile, grace_seconds=30)
        return [{"service": f"kafka-{n.node_id}", "state": "stopped"} for n in self.nodes]

    def status(self) -> list[dict[str, object]]:
        results: list[dict[str, object]] = []
        for node in self.nodes:
            pid = read_pid(node.pidfile)
            state = "down"
            if pid is not None:
                state = "running" if broker_answers(node.address, timeout=1.0) else "starting"
            results.append(
                {
                    "service": f"kafka-{node.node_id}",
                    "managed": True,
                    "state": state,
                    "pid": pid,
                    "port": node.port,
                }
            )
        return results
