"""`pin stack up --secure`: the local services as a managed estate runs them (CONTRACT section 8),
to try the product against TLS and passwords before production does.

Under `<state>/secure/`, apart from the plain stack (which keeps running on its own ports):
- one CA (`tls/ca.crt`) that signed every server's certificate;
- PostgreSQL with TLS and SCRAM only, plaintext refused, a non-superuser owner `pin`
  (stack/postgres.py, `secure=True`), its password in a libpq passfile;
- Kafka with SASL_SSL listeners (SCRAM-SHA-512/256, PLAIN) and an mTLS one (stack/secure_kafka.py);
  the exported client file is the SCRAM-SHA-512 one, Amazon MSK's shape;
- clickhouse-server 18.16 with its TLS port, a `writer` (the loader, migrate) and a `reader`
  (`readonly = 2`: `pin devstats labels`, `pin api serve`) (stack/clickhouse_server.py).

Ports are chosen free once and kept in `ports.json`, so `up` is idempotent and the printed
settings stay valid. `exports()` are the settings of the owner (`pin db migrate`); the worker and
reader login roles an administrator would make are in docs/production.md, "Connecting to
production services".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pin_pipelines.clickhouse import ServerAddress
from pin_pipelines.config import Settings
from pin_pipelines.stack.clickhouse_server import READER, WRITER, LocalClickHouseServer
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.postgres import LocalPostgres
from pin_pipelines.stack.process import free_port, read_pid
from pin_pipelines.stack.secure_kafka import SecureKafka
from pin_pipelines.stack.tls import LocalCA

Result = dict[str, Any]
#: The Kafka client kind whose properties file the exported settings name.
KAFKA_CLIENT = "scram-sha-512"


class SecuredEstate:
    """The three secured services of `pin stack up --secure` under `<state>/secure`."""

    def __init__(self, settings: Settings) -> None:
        self.folder = settings.state_dir / "secure"
        self.ca = LocalCA(self.folder / "tls")
        self._plain_kafka_libs = LocalKafka(settings).libs

    def _ports(self) -> dict[str, int]:
        path = self.folder / "ports.json"
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            names = ("postgres", "clickhouse", "clickhouse_tls")
            path.write_text(json.dumps({name: free_port() for name in names}))
        ports: dict[str, int] = json.loads(path.read_text())
        return ports

    @property
    def postgres(self) -> LocalPostgres:
        env = {
            **os.environ,
            "PIN_STATE_DIR": str(self.folder),
            "PIN_PG_DSN": f"postgresql://pin@127.0.0.1:{self._ports()['postgres']}/pin",
        }
        return LocalPostgres(Settings.from_env(env), secure=True)

    @property
    def kafka(self) -> SecureKafka:
        return SecureKafka(self.folder / "kafka", self._plain_kafka_libs, ca=self.ca)

    @property
    def clickhouse(self) -> LocalClickHouseServer:
        ports = self._ports()
        admin = ServerAddress("127.0.0.1", ports["clickhouse"], "default", "")
        return LocalClickHouseServer(
            admin, self.folder, tls_port=ports["clickhouse_tls"], ca=self.ca
        )

    def is_running(self) -> bool:
        """Whether any of its servers runs (without starting or creating anything)."""
        if not (self.folder / "ports.json").exists():
            return False
        return (
            any(
                pid is not None
                for pid in (
                    read_pid(self.kafka.node.pidfile),
                    read_pid(self.clickhouse.pidfile),
                )
            )
            or self.postgres.running()
        )

    def up(self) -> list[Result]:
        self.ca.ensure()
        results = [self.postgres.up(), self.kafka.up(), self.clickhouse.up()]
        self.kafka.client_properties(KAFKA_CLIENT)
        return results

    def down(self) -> list[Result]:
        if not (self.folder / "ports.json").exists():
            return []
        return [self.clickhouse.down(), self.kafka.down(), self.postgres.down()]

    def status(self) -> list[Result]:
        return [self.postgres.status(), self.kafka.status(), self.clickhouse.status()]

    def exports(self) -> dict[str, str]:
        """The settings every `pin` command and `pin serve` run with against this estate (the
        owner's, for `pin db migrate`; a login role of pin_worker takes the same with its user)."""
        return {
            "PIN_PG_DSN": self.postgres.client_dsn(),
            "PIN_KAFKA_BOOTSTRAP": self.kafka.bootstrap(KAFKA_CLIENT),
            "PIN_KAFKA_CONFIG": str(self.kafka.clients / f"{KAFKA_CLIENT}.properties"),
            **self.clickhouse.client_env(WRITER),
        }

    def reader_clickhouse(self) -> dict[str, str]:
        """The ClickHouse settings of the read API and `pin devstats labels` (`readonly = 2`)."""
        return self.clickhouse.client_env(READER)

    def password_files(self) -> list[Path]:
        """Every file holding a secret of the estate (tests search outputs for their content)."""
        return sorted(p for p in self.folder.rglob("*.password") if p.is_file())
