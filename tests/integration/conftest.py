"""The fixtures that need services, for the integration tests: the emptied outbox, the settings
of the real local services, the session's embedded dimension emptied, the whole pipeline, drain →
relay → loader into it, and a Dagster instance on a database of its own.

The services themselves are session fixtures of tests/support (the test database, the shared and
the private brokers, the ClickHouse paths), registered for every test by tests/conftest.py. They
come from `pin stack up` (CI runs it first). A missing service FAILS the tests that need it:
nothing here skips. Nothing outside tests/integration/ sees the fixtures of this file, and only
the conftests of tests/integration/ and tests/e2e/ point `pin`'s environment at the test services,
so tests/unit runs with no service up.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pin_pipelines.clickhouse import ClickHouse, open_clickhouse
from pin_pipelines.config import SOURCE_ROOT, Settings, dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.kafka import (
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    TOPIC_PROJECT,
    ensure_topics,
)
from pin_pipelines.relay import relay_once
from tests.support.database import use_test_database
from tests.support.pg import dbname
from tests.support.recalc import drain_until_empty
from tests.support.shared_kafka import use_shared_broker

use_test_database()
use_shared_broker()

DIM = "pin_dev_stats.dim_layout_group"


@pytest.fixture
def outbox(db: psycopg.Connection, kafka_bootstrap: str) -> psycopg.Connection:
    """An empty outbox and dead-letter table; the three snapshot topics exist."""
    db.execute("TRUNCATE chessboard.outbox_events, chessboard.outbox_dead_letters")
    ensure_topics(kafka_bootstrap, (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP))
    return db


@pytest.fixture
def settings(pg_dsn: str, chdb_url: str, kafka_bootstrap: str, tmp_path: Path) -> Settings:
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_CLICKHOUSE_URL": chdb_url,
            "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "PIN_STATE_DIR": str(tmp_path),
        }
    )


@pytest.fixture
def ch(chdb_url: str) -> Iterator[ClickHouse]:
    """The session's embedded dimension, emptied: other tests' groups are not this test's drift."""
    with open_clickhouse(chdb_url) as client:
        client.command(f"TRUNCATE TABLE {DIM}")
        yield client


@pytest.fixture
def pipeline(
    db: psycopg.Connection, settings: Settings, loader_options: LoadOptions
) -> Iterator[Callable[[], None]]:
    """drain → relay → loader. Layout-group events go to this test's private topic (registered
    with the relay), so test sessions sharing the broker never load each other's groups."""
    db.execute(
        "INSERT INTO chessboard.outbox_topics (topic, required_fields)"
        " SELECT %s, required_fields FROM chessboard.outbox_topics WHERE topic = %s"
        " ON CONFLICT (topic) DO NOTHING",
        (loader_options.topic, TOPIC_LAYOUT_GROUP),
    )

    def run() -> None:
        drain_until_empty(db, settings.pg_dsn)
        db.execute(
            "UPDATE chessboard.outbox_events SET topic = %s WHERE topic = %s",
            (loader_options.topic, TOPIC_LAYOUT_GROUP),
        )
        relay_once(settings)
        summary = load_once(settings, loader_options)
        assert summary.complete and summary.dead_lettered == 0

    yield run


@pytest.fixture
def dagster_db(pg_dsn: str) -> Iterator[str]:
    """A fresh database for a Dagster instance's storage, dropped afterwards."""
    name = f"pin_test_dagster_{uuid.uuid4().hex[:8]}"
    admin = dsn_with_dbname(pg_dsn, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield dsn_with_dbname(pg_dsn, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_instance(
    dagster_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dg.DagsterInstance]:
    """An instance of the repository's own dagster.yaml (run, event and schedule storage in
    PostgreSQL, run queue, logging), on a database of its own; compute logs under its home."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(SOURCE_ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", dagster_pg_url_from(dagster_db, dbname(dagster_db)))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance
