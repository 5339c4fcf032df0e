"""Debian's ZooKeeper (3.8) for the local ClickHouse cluster: one standalone server on loopback.

ClickHouse 18.16 keeps its replication log, the replicas' part lists, insert-deduplication hashes
and the distributed DDL queue in ZooKeeper (current ClickHouse ships ClickHouse Keeper for the
same protocol). The package's jars are run with plain `java`, like Kafka's (stack/kafka.py); its
own init scripts and /etc/zookeeper are not used: config, data and log live under the state folder.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import (
    apt_install,
    port_open,
    read_pid,
    start_detached,
    stop_pid,
    wait_until,
)

SERVICE = "zookeeper"
PACKAGE = "zookeeper"
#: The package's jar (its manifest lists the dependencies) and an SLF4J binding that logs to
#: stderr, which start_detached appends to the service's log (libslf4j-java, a dependency).
CLASSPATH = ("/usr/share/java/zookeeper.jar", "/usr/share/java/slf4j-simple.jar")
#: A small server beside three ClickHouse servers on a 2-core machine: the serial collector (no
#: concurrent GC threads) and the C1 compiler only (less JIT work) measured about half the CPU per
#: replicated insert of the JVM's default G1 and tiered compilation. No worker pools (the one
#: selector thread reads and writes the connections, the commit processor applies the requests
#: itself): with three clients, the hand-offs between pools of threads cost more CPU than the work
#: they share (measured over 50 replicated 1,000-row inserts: ZooKeeper's CPU 0.45-0.6 s with the
#: default pools, 0.3-0.37 s without).
JVM_OPTIONS = (
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Dzookeeper.nio.numSelectorThreads=1",
    "-Dzookeeper.nio.numWorkerThreads=0",
    "-Dzookeeper.commitProcessor.numWorkerThreads=0",
)
#: Standalone mode: QuorumPeerMain runs a single server when its config names no peers.
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

#: tickTime 1 s lets ClickHouse ask for sessions as short as 2 s (minSessionTimeout = 2 ticks);
#: stack/clickhouse_cluster.py asks for 5 s, so a replica killed with -9 and restarted finds its
#: old session (and its `is_active` node) gone within seconds instead of the default 30 s.
ZOO_CFG = """\
# Written by `pin stack up`; edits are overwritten.
tickTime=1000
initLimit=10
syncLimit=5
dataDir={data}
clientPort={port}
clientPortAddress=127.0.0.1
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr
autopurge.snapRetainCount=3
autopurge.purgeInterval=1
"""


class LocalZooKeeper:
    """Start, stop and report one ZooKeeper server under `root`, on 127.0.0.1:`port`."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.pidfile = root / "zookeeper.pid"
        self.logfile = root / "zookeeper.log"

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        pid = read_pid(self.pidfile)
        action = "already running"
        if pid is None:
            if port_open("127.0.0.1", self.port):
                return self._not_managed()
            java = self._java()
            pid = start_detached(
                [
                    java,
                    *JVM_OPTIONS,
                    "-cp",
                    ":".join(CLASSPATH),
                    MAIN_CLASS,
                    str(self._write_config()),
                ],
                pidfile=self.pidfile,
                logfile=self.logfile,
                cwd=self.root,
            )
            action = "started"
        launched = time.monotonic()
        wait_until(self.ready, timeout=60, what="ZooKeeper", logfile=self.logfile, pid=pid)
        return {
            "service": SERVICE,
            "state": action,
            "version": self.version(),
            "port": self.port,
            "ready_seconds": round(time.monotonic() - launched, 2),
            "total_seconds": round(time.monotonic() - started, 2),
        }

    def down(self) -> dict[str, object]:
        stopped = stop_pid(self.pidfile, grace_seconds=15)
        return {"service": SERVICE, "state": "stopped" if stopped else "not running"}

    def status(self) -> dict[str, object]:
        pid = read_pid(self.pidfile)
        version = self.version()
        state = "running" if version else ("starting" if pid else "down")
        return {
            "service": SERVICE,
            "managed": pid is not None,
            "state": state,
            "pid": pid,
            "port": self.port,
            "version": version,
        }

    def ready(self) -> bool:
        """The server serves requests: `srvr` answers with its version (`ruok` answers `imok`
        as soon as the process listens, before it serves)."""
        return self.version() is not None

    def version(self) -> str | None:
        """`3.8.0` from the server's `srvr` answer (`Zookeeper version: 3.8.0-<build>, …`)."""
        for line in (self._ask("srvr") or "").splitlines():
            if line.startswith("Zookeeper version:"):
                return line.split(":", 1)[1].split("-")[0].strip()
        return None

    def _ask(self, command: str) -> str | None:
        """A four-letter command's answer (ZooKeeper closes the connection after it)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(command.encode())
                chunks = []
                while chunk := sock.recv(4096):
                    chunks.append(chunk)
        except OSError:
            return None
        return b"".join(chunks).decode(errors="replace").strip()

    def _not_managed(self) -> dict[str, object]:
        if not self.ready():
            raise PinError(
                f"127.0.0.1:{self.port} is taken by something that is not a ZooKeeper serving "
                "requests: stop it, or start the cluster on other ports"
            )
        return {"service": SERVICE, "managed": False, "state": "external", "port": self.port}

    def _java(self) -> str:
        """java comes with the package (it depends on default-jre)."""
        if not all(Path(jar).exists() for jar in CLASSPATH):
            apt_install([PACKAGE])
        java = shutil.which("java")
        if java is None or not all(Path(jar).exists() for jar in CLASSPATH):
            raise PinError(f"{PACKAGE} (with java) is not installed and could not be installed")
        return java

    def _write_config(self) -> Path:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "zoo.cfg"
        config.write_text(ZOO_CFG.format(data=self.root / "data", port=self.port))
        return config
