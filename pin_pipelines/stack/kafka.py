"""One Apache Kafka broker in KRaft mode: Apache's own jars from Maven Central, run with `java`."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import broker_answers
from pin_pipelines.stack.process import (
    apt_install,
    read_pid,
    start_detached,
    stop_pid,
    wait_until,
)

POM = Path(__file__).with_name("kafka-broker.pom.xml")
KAFKA_VERSION = re.search(r"<kafka.version>([^<]+)<", POM.read_text()).group(1)  # type: ignore[union-attr]
#: The local broker's heap (docs/kafka.md, "The local broker's size"): what one node with the
#: project's topics and a test suite's clients needs (its heap after a full GC at rest: see
#: docs/benchmarks.md), with room for the log cleaner's dedupe buffer and the suite's bursts;
#: Kafka's own scripts give 1 GiB, sized for production traffic.
HEAP = "-Xmx256m"

LOG4J2 = """\
Configuration:
  status: warn
  Appenders:
    File:
      name: file
      fileName: "{logfile}"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: info
      AppenderRef:
        - ref: file
    Logger:
      - name: kafka.request.logger
        level: warn
      - name: org.apache.kafka.controller
        level: warn
"""


#: Broker settings of a single node: every internal topic has its one replica, and threads and
#: buffers for one node's clients on a machine of a few cores (Kafka's defaults are a production
#: server's: 8 request handlers, 3 network threads per listener, 10 background threads, a 128 MiB
#: dedupe buffer, 50 transaction-log partitions). Each idle thread still wakes several times a
#: second; docs/kafka.md says how to size a production broker.
SINGLE_NODE_CONFIG = (
    "num.partitions=3\n"
    "offsets.topic.replication.factor=1\n"
    "offsets.topic.num.partitions=3\n"
    "transaction.state.log.replication.factor=1\n"
    "transaction.state.log.min.isr=1\n"
    "transaction.state.log.num.partitions=3\n"
    "share.coordinator.state.topic.replication.factor=1\n"
    "share.coordinator.state.topic.min.isr=1\n"
    "num.network.threads=2\n"
    "num.io.threads=2\n"
    "background.threads=2\n"
    "num.recovery.threads.per.data.dir=1\n"
    "log.cleaner.threads=1\n"
    "log.cleaner.dedupe.buffer.size=16777216\n"
)


@dataclass(frozen=True)
class Listener:
    """A client listener besides the PLAINTEXT one (a secured broker's, stack/secure_kafka.py):
    its name, security protocol (SSL, SASL_SSL, ...) and port."""

    name: str
    protocol: str
    port: int


@dataclass(frozen=True)
class KafkaNode:
    """One KRaft process (broker and controller) with its files under `home`. Its PLAINTEXT
    listener (`port`) is the inter-broker one; `listeners` are more, for clients."""

    home: Path
    libs: Path
    node_id: int
    port: int
    controller_port: int
    listeners: tuple[Listener, ...] = ()

    @property
    def pidfile(self) -> Path:
        return self.home / "kafka.pid"

    @property
    def logfile(self) -> Path:
        return self.home / "server.log"

    @property
    def output(self) -> Path:
        """The JVM's own stdout and stderr, appended across starts."""
        return self.home / "stdout.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(
        self,
        *,
        voters: str,
        cluster_id: str,
        config: str,
        heap: str,
        format_args: tuple[str, ...] = (),
    ) -> tuple[int, bool]:
        """Write its config, format its storage once (with `format_args`, e.g. the SCRAM users
        of `--add-scram`), start it unless it runs; returns the pid and whether it was started
        now."""
        pid = read_pid(self.pidfile)
        if pid is not None:
            return pid, False
        properties = self._write_config(voters, config)
        self._format(properties, cluster_id, format_args)
        pid = start_detached(
            [
                java(),
                heap,
                "-XX:+UseG1GC",
                "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.home / 'log4j2.yaml'}",
                "-cp",
                f"{self.libs}/*",
                "kafka.Kafka",
                str(properties),
            ],
            pidfile=self.pidfile,
            logfile=self.output,
        )
        return pid, True

    def _write_config(self, voters: str, config: str) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "log4j2.yaml").write_text(LOG4J2.format(logfile=self.logfile))
        properties = self.home / "server.properties"
        more = "".join(f",{x.name}://127.0.0.1:{x.port}" for x in self.listeners)
        protocols = "".join(f",{x.name}:{x.protocol}" for x in self.listeners)
        properties.write_text(
            "# Written by `pin stack up`; edits are overwritten.\n"
            "process.roles=broker,controller\n"
            f"node.id={self.node_id}\n"
            f"controller.quorum.voters={voters}\n"
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
            f"CONTROLLER://127.0.0.1:{self.controller_port}{more}\n"
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}{more}\n"
            "controller.listener.names=CONTROLLER\n"
            f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT{protocols}\n"
            "inter.broker.listener.name=PLAINTEXT\n"
            f"log.dirs={self.home / 'data'}\n"
            "group.initial.rebalance.delay.ms=0\n"
            "log.retention.hours=168\n" + config
        )
        return properties

    def _format(self, properties: Path, cluster_id: str, more: tuple[str, ...]) -> None:
        if (self.home / "data" / "meta.properties").exists():
            return
        result = subprocess.run(
            [
                java(),
                "-cp",
                f"{self.libs}/*",
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(properties),
                *more,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise PinError(f"formatting Kafka storage failed: {result.stderr.strip()[-300:]}")


def new_cluster_id() -> str:
    """A KRaft cluster id as Kafka makes them (Uuid.randomUuid): URL-safe base64 of 16 random
    bytes, never starting with "-", which the storage tool would read as an option (one id in
    64 did: a private test broker then failed to format)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class LocalKafka:
    """The default: one node on PIN_KAFKA_BOOTSTRAP's port, its controller on the next one."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.host, self.port = settings.kafka_host_port
        self.root = settings.state_dir / "kafka"
        self.libs = self.root / f"libs-{KAFKA_VERSION}"
        self.node = KafkaNode(self.root, self.libs, 1, self.port, self.port + 1)
        self.pidfile = self.node.pidfile
        self.logfile = self.node.logfile

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        if not self.settings.kafka_is_local:
            if not broker_answers(self.settings.kafka_bootstrap):
                raise PinError(f"external Kafka at {self.settings.kafka_bootstrap} does not answer")
            return {"service": "kafka", "state": "external", "ready_seconds": 0.0}
        fetch_jars(self.libs)
        pid, fresh = self.node.start(
            voters=f"1@127.0.0.1:{self.node.controller_port}",
            cluster_id=new_cluster_id(),
            config=SINGLE_NODE_CONFIG,
            heap=HEAP,
        )
        launched = time.monotonic()
        wait_until(
            lambda: broker_answers(self.settings.kafka_bootstrap, timeout=1.0),
            timeout=60,
            what="Kafka",
            logfile=self.logfile,
            pid=pid,
            output=self.node.output,
        )
        return {
            "service": "kafka",
            "state": "started" if fresh else "already running",
            "version": KAFKA_VERSION,
            "port": self.port,
            "ready_seconds": round(time.monotonic() - launched, 2),
            "total_seconds": round(time.monotonic() - started, 2),
        }

    def down(self) -> dict[str, object]:
        stop_pid(self.pidfile, grace_seconds=30)
        return {"service": "kafka", "state": "stopped"}

    def status(self) -> dict[str, object]:
        if not self.settings.kafka_is_local:
            state = "running" if broker_answers(self.settings.kafka_bootstrap) else "down"
            return {"service": "kafka", "managed": False, "state": state}
        pid = read_pid(self.pidfile)
        state = "down"
        if pid is not None:
            state = "running" if broker_answers(self.settings.kafka_bootstrap) else "starting"
        return {"service": "kafka", "managed": True, "state": state, "pid": pid, "port": self.port}


def java() -> str:
    found = shutil.which("java")
    if found is None:
        apt_install(["openjdk-17-jre-headless"])
        found = shutil.which("java")
    if found is None:
        raise PinError("java is not installed and could not be installed")
    return found


def fetch_jars(libs: Path) -> None:
    """Resolve the broker and its runtime dependencies once; Maven's cache serves later runs."""
    if (libs / ".complete").exists():
        return
    if shutil.which("mvn") is None:
        apt_install(["maven"])
    java()
    partial = libs.with_name(libs.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    result = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={partial}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        raise PinError(f"fetching Kafka {KAFKA_VERSION} from Maven failed: {' | '.join(tail)}")
    (partial / ".complete").touch()
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
