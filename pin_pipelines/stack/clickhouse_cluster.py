"""`pin stack up --clickhouse-cluster`: a ClickHouse cluster on loopback for the cluster path
(`PIN_CLICKHOUSE_CLUSTER`, clickhouse/cluster.py) and its tests.

Small on purpose (the development machine has 2 cores): one ZooKeeper (stack/zookeeper.py) and
three Debian clickhouse-server 18.16 processes, each with its own config, data folder and ports
under `<state_dir>/clickhouse-cluster/`. Shard 1 has two replicas, shard 2 one. The ports are
derived from one base (BASE_PORT, 9300), clear of the single server (9000), Kafka (9092-9093),
PostgreSQL (5432) and Dagster (3000):

| process   | shard | replica | native (PIN_CLICKHOUSE_URL) | HTTP      | interserver (fetches) |
|-----------|-------|---------|-----------------------------|-----------|-----------------------|
| ZooKeeper |       |         | base (9300)                 |           |                       |
| s1r1      | 1     | s1r1    | base + 1 (9301)             | base + 11 | base + 21             |
| s1r2      | 1     | s1r2    | base + 2 (9302)             | base + 12 | base + 22             |
| s2r1      | 2     | s2r1    | base + 3 (9303)             | base + 13 | base + 23             |

Every server gets the same `remote_servers` (the cluster, named PIN_CLICKHOUSE_CLUSTER or `pin`,
`internal_replication` on: a Distributed insert writes one replica and replication copies it),
its own `macros` (shard, replica: the replicated table's ZooKeeper path and replica name), the
ZooKeeper and the distributed DDL queue. The users are the URL's user and password.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from xml.sax.saxutils import escape

from pin_pipelines.clickhouse import DATABASE, ServerAddress, parse_clickhouse_url
from pin_pipelines.clickhouse.server import ServerClickHouse  # see FACE_EXCEPTIONS, test_layering
from pin_pipelines.config import LOOPBACK_HOSTS, Settings
from pin_pipelines.errors import PinError
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import read_pid
from pin_pipelines.stack.zookeeper import LocalZooKeeper

SERVICE = "clickhouse-cluster"
FOLDER = "clickhouse-cluster"
#: The cluster's name in remote_servers when PIN_CLICKHOUSE_CLUSTER does not name it.
DEFAULT_CLUSTER = "pin"
BASE_PORT = 9300
#: ZooKeeper session of each server: a replica killed with -9 leaves its `is_active` node behind
#: until this expires, and stays read-only after a restart until then (ClickHouse's default 30 s).
SESSION_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class Replica:
    """One server of the topology: shard number and replica name (its macros)."""

    shard: int
    name: str


#: Shard 1 with two replicas, shard 2 with one; the order gives each server its ports.
TOPOLOGY = (Replica(1, "s1r1"), Replica(1, "s1r2"), Replica(2, "s2r1"))

#: Each server's part of config.xml. `replicated_max_ratio_of_wrong_parts` 1 (0.5 by default): a
#: server killed with -9 between writing an insert's part and registering it in ZooKeeper finds
#: that part unexpected at its start (the insert failed, and the loader wrote it again on the
#: other replica). It detaches such parts and starts, unless they hold more than this share of
#: the rows on its disk: then it refuses to start at all. A local cluster's table holds a few
#: dozen rows, so one such part is over half of them (CI saw 25 of 30); a production table's
#: share stays tiny, and the runbook's remedy there is the force_restore_data flag.
NODE_CONFIG = """\
    <merge_tree><replicated_max_ratio_of_wrong_parts>1</replicated_max_ratio_of_wrong_parts></merge_tree>
    <interserver_http_host>127.0.0.1</interserver_http_host>
    <interserver_http_port>{interserver_port}</interserver_http_port>
    <zookeeper>
        <node><host>127.0.0.1</host><port>{zookeeper_port}</port></node>
        <session_timeout_ms>{session_timeout_ms}</session_timeout_ms>
    </zookeeper>
    <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>
    <macros><shard>{shard}</shard><replica>{replica}</replica></macros>
    <remote_servers>
        <{cluster}>
{shards}
        </{cluster}>
    </remote_servers>
"""


class ClusterNode(LocalClickHouseServer):
    """A clickhouse-server of the local cluster."""

    def __init__(
        self,
        address: ServerAddress,
        root: Path,
        replica: Replica,
        *,
        http_port: int,
        extra_config: str,
    ) -> None:
        super().__init__(address, root, http_port, folder=replica.name, extra_config=extra_config)
        self.replica = replica

    @property
    def url(self) -> str:
        """PIN_CLICKHOUSE_URL for this server (any server of the cluster serves all of it)."""
        address = self.address
        credentials = quote(address.user, safe="") + (
            f":{quote(address.password, safe='')}" if address.password else ""
        )
        return f"clickhouse://{credentials}@{address.host}:{address.port}/{DATABASE}"

    def ready(self) -> bool:
        """Answers and reaches ZooKeeper (replication and ON CLUSTER DDL can work). A server
        restarted after a kill -9 answers at once, but its replicated tables start replicating
        only once the ZooKeeper session of the process it replaces has expired
        (SESSION_TIMEOUT_MS) and 18.16 retries, every 10 s: docs/runbook.md."""
        client = ServerClickHouse(self.address, connect_timeout=1.0)
        try:
            client.rows("SELECT count() FROM system.zookeeper WHERE path = '/'")
        except PinError:
            return False
        finally:
            client.close()
        return True


class LocalClickHouseCluster:
    """Start, stop and report ZooKeeper and the cluster's servers; idempotent like the others."""

    def __init__(
        self,
        name: str,
        state_dir: Path,
        *,
        user: str = "default",
        password: str = "",
        base_port: int = BASE_PORT,
    ) -> None:
        self.name = name
        self.root = state_dir / FOLDER
        self.zookeeper = LocalZooKeeper(self.root / "zookeeper", base_port)
        shards = _remote_servers_shards(base_port, user, password)
        self.nodes = [
            ClusterNode(
                ServerAddress("127.0.0.1", base_port + i, user, password),
                self.root,
                replica,
                http_port=base_port + 10 + i,
                extra_config=NODE_CONFIG.format(
                    interserver_port=base_port + 20 + i,
                    zookeeper_port=base_port,
                    session_timeout_ms=SESSION_TIMEOUT_MS,
                    shard=replica.shard,
                    replica=replica.name,
                    cluster=name,
                    shards=shards,
                ),
            )
            for i, replica in enumerate(TOPOLOGY, start=1)
        ]

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalClickHouseCluster:
        """The cluster PIN_CLICKHOUSE_CLUSTER names (else `pin`), with the user and password of
        PIN_CLICKHOUSE_URL when that is a server. A loopback URL with the cluster setting must
        name one of the cluster's servers: that is the server the project's clients talk to."""
        name = settings.clickhouse_cluster or DEFAULT_CLUSTER
        target = parse_clickhouse_url(settings.clickhouse_url)
        if not isinstance(target, ServerAddress):
            return cls(name, settings.state_dir)
        cluster = cls(name, settings.state_dir, user=target.user, password=target.password)
        ports = [node.address.port for node in cluster.nodes]
        if (
            settings.clickhouse_cluster is not None
            and target.host in LOOPBACK_HOSTS
            and target.port not in ports
        ):
            raise PinError(
                f"PIN_CLICKHOUSE_URL points at 127.0.0.1:{target.port}, which is not a server of "
                f"the local cluster {cluster.name} (ports {', '.join(map(str, ports))})"
            )
        return cluster

    def node(self, replica: str) -> ClusterNode:
        return next(node for node in self.nodes if node.replica.name == replica)

    def url(self, replica: str = TOPOLOGY[0].name) -> str:
        return self.node(replica).url

    def up(self) -> list[dict[str, object]]:
        results = [self.zookeeper.up()]
        results += [self._report(node, node.up()) for node in self.nodes]
        return results

    def down(self) -> list[dict[str, object]]:
        results = [self._report(node, node.down()) for node in self.nodes]
        return [*results, self.zookeeper.down()]

    def status(self) -> list[dict[str, object]]:
        return [self.zookeeper.status()] + [self._report(n, n.status()) for n in self.nodes]

    def is_running(self) -> bool:
        """Any of its processes runs (`pin stack status|down` then list or stop it unasked)."""
        pidfiles = [self.zookeeper.pidfile, *(node.pidfile for node in self.nodes)]
        return any(read_pid(pidfile) is not None for pidfile in pidfiles)

    def _report(self, node: ClusterNode, result: dict[str, object]) -> dict[str, object]:
        return {
            **result,
            "service": SERVICE,
            "cluster": self.name,
            "shard": node.replica.shard,
            "replica": node.replica.name,
        }


def _remote_servers_shards(base_port: int, user: str, password: str) -> str:
    """The `<shard>` elements of remote_servers: every replica of TOPOLOGY, by shard."""
    shards: dict[int, list[str]] = {}
    for i, replica in enumerate(TOPOLOGY, start=1):
        shards.setdefault(replica.shard, []).append(
            "                <replica><host>127.0.0.1</host>"
            f"<port>{base_port + i}</port><user>{escape(user)}</user>"
            f"<password>{escape(password)}</password></replica>"
        )
    return "\n".join(
        "            <shard>\n"
        "                <internal_replication>true</internal_replication>\n"
        + "\n".join(replicas)
        + "\n            </shard>"
        for replicas in shards.values()
    )
