"""The run's private services: a Kafka broker, embedded ClickHouse folders and Dagster homes, and
the environment of a `pin` command or `pin serve` that uses them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from _common import log

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import ensure_topics
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import free_port, port_open

#: Starts of the private broker before the run gives up (see Private.kafka).
BROKER_STARTS = 3


def _port_pair() -> int:
    """A free port whose successor is free too (the broker's controller listener)."""
    while True:
        port = free_port()
        if not port_open("127.0.0.1", port + 1, timeout=0.2) and port + 1 < 65536:
            return port


class Private:
    """A Kafka broker of this run (jars shared with `pin stack up`'s), embedded ClickHouse
    folders and Dagster homes, under one temporary folder removed at the end."""

    def __init__(self, stack: ExitStack) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pin-bench-scale-"))
        stack.callback(shutil.rmtree, self.root, ignore_errors=True)
        self._stack = stack
        self._kafka: LocalKafka | None = None

    def kafka(self) -> LocalKafka:
        """The broker, started on first use. A start that fails is logged with the broker's
        own output and tried again on new ports (up to BROKER_STARTS times): on the shared
        machine a start can fail (the first full-size soak's broker exited during start-up;
        another engineer's test may take the port pair between its choice and the bind), and one
        failed start must not cost a 36-minute soak."""
        for attempt in range(1, BROKER_STARTS + 1):
            if self._kafka is not None:
                break
            broker = LocalKafka(
                Settings.from_env(
                    {
                        "PIN_STATE_DIR": str(self.root / "state"),
                        "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{_port_pair()}",
                    }
                )
            )
            shared_jars = LocalKafka(Settings.from_env()).libs
            broker.root.mkdir(parents=True)
            if shared_jars.exists():
                broker.libs.symlink_to(shared_jars)
            self._stack.callback(self._stop_broker, broker)
            try:
                broker.up()
            except PinError as error:
                stdout = broker.root / "stdout.log"
                log(
                    "broker start failed",
                    attempt=attempt,
                    error=str(error)[-300:],
                    stdout=stdout.read_text(errors="replace")[-1500:] if stdout.exists() else "",
                )
                if attempt == BROKER_STARTS:
                    raise
                self._stop_broker(broker)
                shutil.rmtree(broker.root)
                continue
            ensure_topics(broker.settings.kafka_bootstrap)
            self._kafka = broker
        assert self._kafka is not None
        return self._kafka

    @staticmethod
    def _stop_broker(broker: LocalKafka) -> None:
        """Stops the broker if it runs, then collects it (this process started it: no zombie,
        whether it was stopped here or died on its own)."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(broker.pidfile.read_text())
            broker.down()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def env(self, dsn: str, label: str) -> dict[str, str]:
        """The environment of a `pin` command or `pin serve` on `dsn`: this run's broker, a
        ClickHouse folder per database, a relay transactional.id per database."""
        return {
            **os.environ,
            "PIN_PG_DSN": dsn,
            "PIN_KAFKA_BOOTSTRAP": self.kafka().settings.kafka_bootstrap,
            "PIN_CLICKHOUSE_URL": f"chdb://{self.root / f'chdb_{label}'}",
            "PIN_STATE_DIR": str(self.root / "state"),
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-bench-scale-{label}",
        }
