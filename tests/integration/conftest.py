"""The fixtures that need services, for the integration tests (and the browser test, which
imports the database ones): the real local services, a dedicated test database with clean tables
per test, the ClickHouse paths (clickhouse_fixtures.py) and the whole pipeline, drain → relay →
loader into the session's embedded dimension.

The services come from `pin stack up` (CI runs it first). A missing service FAILS the tests that
need it: nothing here skips. Nothing outside tests/integration/ and tests/e2e/ sees these, so
tests/unit runs with no service up.
"""

from __future__ import annotations

import os
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
    broker_answers,
    ensure_topics,
)
from pin_pipelines.migrate import migrate_postgres
from pin_pipelines.relay import relay_once
from tests.integration.clickhouse_fixtures import (  # fixtures, registered by the import
    chdb_url,
    clickhouse,
    clickhouse_cluster,
    clickhouse_cluster_url,
    clickhouse_server_url,
    clickhouse_url,
    loader_options,
    loader_settings,
    private_clickhouse_server,
)
from tests.support.pg import dbname
from tests.support.recalc import drain_until_empty
from tests.support.workers import once_per_run, per_worker, run_lock

__all__ = [
    "chdb_url",
    "clickhouse",
    "clickhouse_cluster",
    "clickhouse_cluster_url",
    "clickhouse_server_url",
    "clickhouse_url",
    "loader_options",
    "loader_settings",
    "private_clickhouse_server",
]

#: Tests never touch the dev database `pin`: they own `pin_test` on the same server (under
#: xdist, each worker its own: `pin_test_gw0`, …).
BASE_TEST_PG_DSN = os.environ.get(
    "PIN_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/pin_test"
)
TEST_PG_DSN = dsn_with_dbname(BASE_TEST_PG_DSN, per_worker(dbname(BASE_TEST_PG_DSN)))
os.environ["PIN_PG_DSN"] = TEST_PG_DSN
os.environ.setdefault("PIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092")

CHESSBOARD_TABLES = (
    "property_objects",
    "layouts",
    "layout_groups",
    "buildings",
    "projects",
    "project_recalc_requests",
    "outbox_events",
)
DIM = "pin_dev_stats.dim_layout_group"


@pytest.fixture(scope="session")
def pg_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The name of a database migrated once per test run, by the first worker to ask (dropped
    first if a previous run left it): each worker's test database is a copy of it."""
    template = f"{dbname(BASE_TEST_PG_DSN)}_template"
    with once_per_run(tmp_path_factory, "pg-template") as first:
        if first:
            with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{template}"')
            migrate_postgres(dsn_with_dbname(BASE_TEST_PG_DSN, template))
    return template


@pytest.fixture(scope="session")
def pg_dsn(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """This worker's test database, a fresh copy of the migrated template (dropped first if a
    previous run left it). The copies are made one at a time: CREATE DATABASE … TEMPLATE
    refuses while any other session is connected to the template."""
    name = dbname(TEST_PG_DSN)
    with (
        run_lock(tmp_path_factory, "pg-copy"),
        psycopg.connect(_admin_dsn(), autocommit=True) as conn,
    ):
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    return TEST_PG_DSN


def _admin_dsn() -> str:
    return dsn_with_dbname(BASE_TEST_PG_DSN, "postgres")


@pytest.fixture
def db(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to an emptied chessboard schema with default queue settings."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE " + ", ".join(f"chessboard.{t}" for t in CHESSBOARD_TABLES) + " CASCADE"
        )
        conn.execute("DELETE FROM chessboard.recalc_settings")
        conn.execute("INSERT INTO chessboard.recalc_settings DEFAULT VALUES")
        yield conn


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The real broker of `pin stack up`; a missing broker fails here, clearly."""
    bootstrap = os.environ["PIN_KAFKA_BOOTSTRAP"]
    assert broker_answers(bootstrap, timeout=10), f"Kafka at {bootstrap} does not answer"
    return bootstrap


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
