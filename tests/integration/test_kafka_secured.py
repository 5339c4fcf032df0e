"""Kafka on a secured estate (contract section 8, PIN_KAFKA_CONFIG), against a real secured broker
(stack/secure_kafka.py: SASL_SSL SCRAM-SHA-512/256, SASL_SSL PLAIN, SSL with a client
certificate): the one of the session's secured estate (tests/support/secured.py), started once
per session and met here as new, no topic and no consumer group.

Each listener carries the whole path: `pin db migrate` creates the topics, the relay publishes
outbox events in Kafka transactions, the loader loads them into the session's embedded dimension
and dead-letters a malformed message. Each wrong setting ends `pin db migrate`, `pin outbox relay
--once` and `pin devstats load --once` with one line naming the broker and the cause, within
60 s, and nothing is lost. A SCRAM password rotated on the running broker counts from the next run
once the file is rewritten (successive runs; not under a running `pin serve`).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import KafkaException
from psycopg.types.json import Jsonb

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.kafka import ALL_TOPICS, TOPIC_DEVSTATS_DLQ, TOPIC_LAYOUT_GROUP, admin
from pin_pipelines.kafka_properties import ENV, failure
from pin_pipelines.relay import relay_once
from pin_pipelines.stack.process import read_pid, wait_until
from pin_pipelines.stack.secure_kafka import CLIENTS, SecureKafka
from tests.support.cli import PIN, assert_one_line_error, run_pin, summary
from tests.support.devstats import Group, committed, produce, read_all

#: The secured estate (tests/support/secured.py) starts once per worker: its four modules run
#: one after another on one worker, so it starts once per run.
pytestmark = pytest.mark.xdist_group("secured")

LOADER_GROUP = "test-secured-loader"


@pytest.fixture(scope="module")
def secured(secured_kafka: SecureKafka) -> SecureKafka:
    """The secured broker for the module: the session estate's, as new."""
    return secured_kafka


def secured_settings(pg_dsn: str, chdb_url: str, bootstrap: str, state: Path) -> Settings:
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_CLICKHOUSE_URL": chdb_url,
            "PIN_KAFKA_BOOTSTRAP": bootstrap,
            "PIN_STATE_DIR": str(state),
            # Its own id: the shared broker's relays keep their receipts' sequence apart.
            "PIN_RELAY_TRANSACTIONAL_ID": "pin-outbox-relay-secured-test",
        }
    )


def write_outbox(db: psycopg.Connection, rows: list[tuple[str, dict[str, object]]]) -> None:
    """(message key, event) rows on the layout-group topic, in an emptied outbox."""
    db.execute("TRUNCATE chessboard.outbox_events, chessboard.outbox_dead_letters")
    for key, event in rows:
        db.execute(
            "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
            " VALUES (%s, %s, %s)",
            (TOPIC_LAYOUT_GROUP, key, Jsonb(event)),
        )


def outbox_rows(db: psycopg.Connection) -> int:
    return db.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()[0]  # type: ignore[index]


def stored_name(chdb_url: str, group: Group) -> list[tuple[object, ...]]:
    with open_clickhouse(chdb_url) as ch:
        return ch.rows(
            "SELECT argMax(Name, UpsertedAt) FROM pin_dev_stats.dim_layout_group"
            f" WHERE LayoutGroupId = '{group.id}' GROUP BY LayoutGroupId"
        )


def relay_and_load(db: psycopg.Connection, settings: Settings, chdb_url: str) -> bytes:
    """An outbox event relayed and loaded, and a message that is no event (produced with the
    same PIN_KAFKA_CONFIG: the relay never publishes one) dead-lettered by the loader. Returns
    the bad message's key."""
    good, bad_key = Group(), f"not-an-event-{uuid.uuid4()}".encode()
    write_outbox(db, [(str(good.id), good.event(1))])
    assert relay_once(settings).published == 1
    assert outbox_rows(db) == 0
    produce(settings.kafka_bootstrap, TOPIC_LAYOUT_GROUP, [(bad_key, b"{not json")])
    loaded = load_once(settings, LoadOptions(group=LOADER_GROUP))
    assert loaded.complete and loaded.inserted >= 1 and loaded.dead_lettered >= 1
    assert stored_name(chdb_url, good) == [("Студии v1",)]
    return bad_key


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_migrate_relay_load_and_dead_letter_over_each_secured_listener(
    kind: str,
    secured: SecureKafka,
    db: psycopg.Connection,
    pg_dsn: str,
    chdb_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pin db migrate` (a subprocess with the listener's PIN_KAFKA_CONFIG) makes the topics;
    relay_once and load_once (this process, the same file) publish and load; the event keyed
    that is no event reaches the DLQ topic as it came."""
    config, bootstrap = secured.client_properties(kind), secured.bootstrap(kind)
    env = {
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        ENV: str(config),
        "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
    }
    migrated = summary(run_pin("db", "migrate", env=env))
    assert "kafka_topics_created" in migrated
    monkeypatch.setenv(ENV, str(config))
    assert set(ALL_TOPICS) <= set(admin(bootstrap).list_topics(timeout=10).topics)

    bad_key = relay_and_load(db, secured_settings(pg_dsn, chdb_url, bootstrap, tmp_path), chdb_url)
    dead = [m for m in read_all(bootstrap, TOPIC_DEVSTATS_DLQ) if m.key == bad_key]
    assert len(dead) == 1 and dead[0].headers["source-topic"] == TOPIC_LAYOUT_GROUP


def _wrong_password(broker: SecureKafka) -> str:
    good = broker.client_properties("scram-sha-512").read_text()
    return good.replace(broker.password("scram"), "not-the-password")


def _untrusted(broker: SecureKafka) -> str:
    """No ssl.ca.location: the system's CAs, which never signed the local CA's certificate."""
    good = broker.client_properties("scram-sha-512").read_text().splitlines()
    return "\n".join(line for line in good if not line.startswith("ssl.ca.location")) + "\n"


def _plaintext(_broker: SecureKafka) -> str:
    return "# no security.protocol: PLAINTEXT\n"


def _mechanism_not_offered(broker: SecureKafka) -> str:
    good = broker.client_properties("scram-sha-512").read_text()
    return good.replace("sasl.mechanism=SCRAM-SHA-512", "sasl.mechanism=PLAIN")


@pytest.mark.parametrize(
    ("make_file", "cause"),
    [
        (_wrong_password, "authentication failed"),
        (_untrusted, "certificate not trusted"),
        (_plaintext, "the server requires TLS"),
        (_mechanism_not_offered, "the broker does not offer SASL mechanism PLAIN"),
    ],
    ids=["wrong-password", "untrusted-certificate", "plaintext-at-tls", "mechanism-not-offered"],
)
def test_a_wrong_setting_ends_each_command_with_one_line_naming_the_cause(
    make_file: Callable[[SecureKafka], str],
    cause: str,
    secured: SecureKafka,
    db: psycopg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SCRAM listener with a wrong password, no trusted CA, no TLS at all, or a mechanism
    it does not offer: `pin db migrate`, `pin outbox relay --once` and `pin devstats load --once`
    (run at once) each exit non-zero within 60 s with one line naming `Kafka at host:port` and
    the cause, never a password; the outbox row stays, the loader's group commits nothing."""
    bootstrap = secured.bootstrap("scram")
    monkeypatch.setenv(ENV, str(secured.client_properties("scram-sha-512")))
    offsets_before = committed(bootstrap, TOPIC_LAYOUT_GROUP, LOADER_GROUP)
    group = Group()
    write_outbox(db, [(str(group.id), group.event(1))])
    bad = tmp_path / "bad.properties"
    bad.write_text(make_file(secured))
    secrets = [secured.password("scram")]
    secrets += [
        line.split("=", 1)[1] for line in bad.read_text().splitlines() if "password=" in line
    ]
    env = {**os.environ, "PIN_KAFKA_BOOTSTRAP": bootstrap, ENV: str(bad)}
    env["PIN_RELAY_TRANSACTIONAL_ID"] = "pin-outbox-relay-secured-test"
    commands = {
        "migrate": ("db", "migrate"),
        "relay": ("outbox", "relay", "--once"),
        "load": ("devstats", "load", "--once"),
    }
    started = time.monotonic()
    running = {
        name: subprocess.Popen(
            [PIN, *args],
            env={**env, "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / name}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=90)
        elapsed = time.monotonic() - started
        result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        assert elapsed < 60, f"{name} took {elapsed:.0f}s"
        assert_one_line_error(result, f"Kafka at {bootstrap}", cause)
        assert not any(secret in stdout + stderr for secret in secrets)
    assert outbox_rows(db) == 1
    assert committed(bootstrap, TOPIC_LAYOUT_GROUP, LOADER_GROUP) == offsets_before


def test_a_rotated_scram_password_counts_from_the_next_run(
    secured: SecureKafka,
    db: psycopg.Connection,
    pg_dsn: str,
    chdb_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker's SCRAM password changed through the admin API while it runs, and the file
    rewritten: the old file is refused (authentication failed), the next relay and load runs
    (new clients, this process, no restart of anything) use the new password."""
    pid = read_pid(secured.node.pidfile)
    config, bootstrap = secured.client_properties("scram-sha-512"), secured.bootstrap("scram")
    monkeypatch.setenv(ENV, str(config))
    old = config.read_text()
    secured.rotate_scram_password()
    secured.client_properties("scram-sha-512")
    assert config.read_text() != old

    def new_password_accepted() -> bool:
        try:
            admin(bootstrap).list_topics(timeout=2)
        except KafkaException:
            return False
        return True

    wait_until(new_password_accepted, timeout=30, what="the rotated SCRAM credential")
    relay_and_load(db, secured_settings(pg_dsn, chdb_url, bootstrap, tmp_path), chdb_url)
    assert read_pid(secured.node.pidfile) == pid

    stale = tmp_path / "stale.properties"
    stale.write_text(old)
    monkeypatch.setenv(ENV, str(stale))
    client = admin(bootstrap)
    with pytest.raises(KafkaException) as caught:
        client.list_topics(timeout=3)
    assert "authentication failed" in failure(bootstrap, str(caught.value), client)
