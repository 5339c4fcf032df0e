"""The secured estate of `pin stack up --secure` (stack/secure.py: PostgreSQL with TLS and SCRAM,
Kafka with SASL_SSL and mTLS listeners, clickhouse-server 18.16 with TLS, one CA) for the test
session's secured modules: test_secured_estate, test_pg_secured, test_kafka_secured and
test_clickhouse_secured.

One estate per session (per xdist worker), in a state folder of its own, stopped at the session's
end. Each service starts on first use, so a worker whose modules need ClickHouse alone starts
ClickHouse alone (test_secured_estate starts the rest with `pin stack up --secure` itself). Each
module that takes a service meets it as a new estate has it, whatever the modules before did:
- PostgreSQL: the owner `pin` and its two empty databases, no other role (the modules make the
  group and login roles again; the logins' passwords are new ones);
- Kafka: no topic but Kafka's own, no consumer group (a SCRAM password a module rotated stays
  rotated, on the broker and in its file, which every client file is written from);
- ClickHouse: no database but `default` and `system` (its users live in users.xml, unchanged).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.postgres import SUPERUSER, LocalPostgres
from pin_pipelines.stack.process import read_pid
from pin_pipelines.stack.secure import SecuredEstate
from pin_pipelines.stack.secure_kafka import SecureKafka
from tests.support.private_kafka import clear_broker, link_shared_jars

#: The reset's admin calls go to the broker's plaintext listener, as stack/secure_kafka.py's own.
_PLAINTEXT = {"security.protocol": "PLAINTEXT"}
#: What a new ClickHouse server has.
_CLICKHOUSE_DATABASES = ("default", "system")


@pytest.fixture(scope="session")
def secured_estate() -> Iterator[SecuredEstate]:
    """The session's estate, nothing started yet: its state folder is not pytest's (0700 up the
    path would keep PostgreSQL's OS user from its data), the Kafka jars `pin stack up` fetched
    linked in. Every service of it that runs is stopped at the end, whoever started it."""
    root = Path(tempfile.mkdtemp(prefix="pin-secured-"))
    root.chmod(0o711)
    settings = Settings.from_env({**os.environ, "PIN_STATE_DIR": str(root)})
    estate = SecuredEstate(settings)
    link_shared_jars(LocalKafka(settings).libs)
    try:
        yield estate
    finally:
        stop_estate(estate)
        shutil.rmtree(root, ignore_errors=True)


def stop_estate(estate: SecuredEstate) -> None:
    """Stop whatever of the estate runs, each service even when another one's stop fails
    (`estate.down()` would ask a Kafka never started for its ports)."""
    with contextlib.ExitStack() as stops:  # its callbacks run last to first, every one of them
        stops.callback(estate.postgres.down)
        stops.callback(_stop_detached, estate.clickhouse.pidfile, estate.clickhouse.down)
        if _kafka_made(estate):
            stops.callback(_stop_detached, estate.kafka.node.pidfile, estate.kafka.down)


def _stop_detached(pidfile: Path, down: Callable[[], object]) -> None:
    """`down`, then the server reaped when a fixture started it (a child of this process; not
    when `pin stack up` did)."""
    pid = read_pid(pidfile)
    down()
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _kafka_made(estate: SecuredEstate) -> bool:
    """Whether the estate's Kafka has been started once (it has its ports then)."""
    return estate.folder.joinpath("kafka", "ports.json").exists()


@pytest.fixture(scope="module")
def secured_postgres(secured_estate: SecuredEstate) -> LocalPostgres:
    """The estate's PostgreSQL, up, as new for this module (module docstring)."""
    server = secured_estate.postgres
    clear_postgres(server)
    server.up()
    return server


@pytest.fixture(scope="module")
def secured_kafka(secured_estate: SecuredEstate) -> SecureKafka:
    """The estate's Kafka, up, as new for this module (module docstring)."""
    broker = secured_estate.kafka
    broker.up()
    clear_kafka(broker)
    return broker


@pytest.fixture(scope="module")
def secured_clickhouse(secured_estate: SecuredEstate) -> LocalClickHouseServer:
    """The estate's ClickHouse server, up, as new for this module (module docstring)."""
    server = secured_estate.clickhouse
    server.up()
    clear_clickhouse(server)
    return server


def clear_estate(estate: SecuredEstate) -> None:
    """Whatever runs of the estate as new (for a module that starts it with `pin stack up
    --secure`, which starts the rest and recreates PostgreSQL's databases)."""
    clear_postgres(estate.postgres)
    if _kafka_made(estate):
        clear_kafka(estate.kafka)
    clear_clickhouse(estate.clickhouse)


def clear_postgres(server: LocalPostgres) -> None:
    """Every database but `postgres` and the templates dropped (its sessions ended), every role
    but the superuser and the owner too, with the dropped logins' passwords; `up` makes the
    owner's databases again. Nothing when it does not run."""
    if not server.running():
        return
    with psycopg.connect(server.admin_dsn, autocommit=True, connect_timeout=5) as conn:
        databases = conn.execute(
            "SELECT datname FROM pg_database WHERE NOT datistemplate AND datname <> 'postgres'"
        ).fetchall()
        for (name,) in databases:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
        roles = [
            row[0]
            for row in conn.execute(
                "SELECT rolname FROM pg_roles WHERE rolname !~ '^pg_' AND rolname <> ALL(%s)",
                ([SUPERUSER, server.target.user],),
            )
        ]
        for role in roles:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    for role in roles:
        server.secrets.joinpath(f"{role}.password").unlink(missing_ok=True)
    if roles and server.passfile.exists():
        kept = [
            line
            for line in server.passfile.read_text().splitlines()
            if line.split(":")[3:4] not in ([role] for role in roles)
        ]
        server.passfile.write_text("".join(f"{line}\n" for line in kept))


def clear_kafka(broker: SecureKafka) -> None:
    """Every consumer group and every topic but Kafka's own deleted, through the plaintext
    listener. Nothing when it does not run."""
    if read_pid(broker.node.pidfile) is not None:
        clear_broker(broker.bootstrap("plaintext"), _PLAINTEXT)


def clear_clickhouse(server: LocalClickHouseServer) -> None:
    """Every database but a new server's dropped (the dimension's `pin_dev_stats`), as its
    admin on the plaintext loopback port. Nothing when it does not run."""
    if read_pid(server.pidfile) is None:
        return
    address = server.address
    with open_clickhouse(f"clickhouse://{address.user}@{address.host}:{address.port}/") as ch:
        for (name,) in ch.rows("SELECT name FROM system.databases"):
            if name not in _CLICKHOUSE_DATABASES:
                ch.command(f"DROP DATABASE IF EXISTS `{name}`")
