"""Shared fixtures: the real local services, a dedicated test database, clean tables per test.

The services come from `pin stack up` (CI runs it first). A missing service FAILS the tests that
need it: nothing here skips.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psycopg
import pytest

from pin_pipelines.config import dsn_with_dbname
from pin_pipelines.migrate import migrate_postgres

#: Tests never touch the dev database `pin`: they own `pin_test` on the same server.
TEST_PG_DSN = os.environ.get("PIN_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/pin_test")
os.environ["PIN_PG_DSN"] = TEST_PG_DSN
os.environ.setdefault("PIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092")

pytest_plugins = ["tests.integration.clickhouse_fixtures"]

CHESSBOARD_TABLES = (
    "property_objects",
    "layouts",
    "layout_groups",
    "buildings",
    "projects",
    "project_recalc_requests",
    "outbox_events",
)


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    """A freshly created and migrated test database (dropped first if a previous run left it)."""
    admin = dsn_with_dbname(TEST_PG_DSN, "postgres")
    dbname = TEST_PG_DSN.rsplit("/", 1)[1]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dbname}"')
    migrate_postgres(TEST_PG_DSN)
    return TEST_PG_DSN


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
    from pin_pipelines.kafka import broker_answers

    bootstrap = os.environ["PIN_KAFKA_BOOTSTRAP"]
    assert broker_answers(bootstrap, timeout=10), f"Kafka at {bootstrap} does not answer"
    return bootstrap


@pytest.fixture
def outbox(db: psycopg.Connection, kafka_bootstrap: str) -> psycopg.Connection:
    """An empty outbox and dead-letter table; the three snapshot topics exist."""
    from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT, ensure_topics

    db.execute("TRUNCATE chessboard.outbox_events, chessboard.outbox_dead_letters")
    ensure_topics(kafka_bootstrap, (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP))
    return db
