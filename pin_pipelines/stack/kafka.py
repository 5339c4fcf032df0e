"""One Apache Kafka broker in KRaft mode: Apache's own jars from Maven Central, run with `java`."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
import uuid
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
HEAP = "-Xmx768m"

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


class LocalKafka:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.host, self.port = settings.kafka_host_port
        self.controller_port = self.port + 1
        self.root = settings.state_dir / "kafka"
        self.libs = self.root / f"libs-{KAFKA_VERSION}"
        self.data = self.root / "data"
        self.pidfile = self.root / "kafka.pid"
        self.logfile = self.root / "server.log"
        self.stdout_log = self.root / "stdout.log"

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        if not self.settings.kafka_is_local:
            if not broker_answers(self.settings.kafka_bootstrap):
                raise PinError(f"external Kafka at {self.settings.kafka_bootstrap} does not answer")
            return {"service": "kafka", "state": "external", "ready_seconds": 0.0}
        pid = read_pid(self.pidfile)
        action = "already running"
        if pid is None:
            self._fetch_jars()
            config = self._write_config()
            self._format(config)
            pid = start_detached(
                [
                    self._java(),
                    HEAP,
                    "-XX:+UseG1GC",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={self.root / 'log4j2.yaml'}",
                    "-cp",
                    f"{self.libs}/*",
                    "kafka.Kafka",
                    str(config),
                ],
                pidfile=self.pidfile,
                logfile=self.stdout_log,
            )
            action = "started"
        launched = time.monotonic()
        wait_until(
            lambda: broker_answers(self.settings.kafka_bootstrap, timeout=1.0),
            timeout=60,
            what="Kafka",
            logfile=self.logfile,
            pid=pid,
        )
        return {
            "service": "kafka",
            "state": action,
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

    def _java(self) -> str:
        java = shutil.which("java")
        if java is None:
            apt_install(["openjdk-17-jre-headless"])
            java = shutil.which("java")
        if java is None:
            raise PinError("java is not installed and could not be installed")
        return java

    def _fetch_jars(self) -> None:
        """Resolve the broker and its runtime dependencies once; Maven's cache serves later runs."""
        if (self.libs / ".complete").exists():
            return
        if shutil.which("mvn") is None:
            apt_install(["maven"])
        self._java()
        partial = self.libs.with_name(self.libs.name + ".partial")
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
        shutil.rmtree(self.libs, ignore_errors=True)
        partial.rename(self.libs)

    def _write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "log4j2.yaml").write_text(LOG4J2.format(logfile=self.logfile))
        config = self.root / "server.properties"
        config.write_text(
            "# Written by `pin stack up`; edits are overwritten.\n"
            "process.roles=broker,controller\n"
            "node.id=1\n"
            f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}\n"
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}\n"
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}\n"
            "controller.listener.names=CONTROLLER\n"
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n"
            "inter.broker.listener.name=PLAINTEXT\n"
            f"log.dirs={self.data}\n"
            "num.partitions=3\n"
            "offsets.topic.replication.factor=1\n"
            "offsets.topic.num.partitions=3\n"
            "transaction.state.log.replication.factor=1\n"
            "transaction.state.log.min.isr=1\n"
            "share.coordinator.state.topic.replication.factor=1\n"
            "share.coordinator.state.topic.min.isr=1\n"
            "group.initial.rebalance.delay.ms=0\n"
            "log.retention.hours=168\n"
        )
        return config

    def _format(self, config: Path) -> None:
        if (self.data / "meta.properties").exists():
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        result = subprocess.run(
            [
                self._java(),
                "-cp",
                f"{self.libs}/*",
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(config),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise PinError(f"formatting Kafka storage failed: {result.stderr.strip()[-300:]}")
