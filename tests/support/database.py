"""The test database on the PostgreSQL server of `pin stack up`: a template migrated once per run,
this worker's copy of it (`pg_dsn`) and a connection to its emptied chessboard schema (`db`).

Registered for every test by `pytest_plugins` in tests/conftest.py: a fixture starts nothing until
a test asks for it, so tests/unit runs with no service up. A missing server FAILS the test. The
environment of `pin` (PIN_PG_DSN) is pointed at the test database only by the conftests of
tests/integration and tests/e2e (`use_test_database`), never for tests/unit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psycopg
import pytest

from pin_pipelines.config import dsn_with_dbname
from pin_pipelines.migrate import migrate_postgres
from tests.support.pg import dbname
from tests.support.workers import once_per_run, per_worker, run_lock

#: Tests never touch the dev database `pin`: they own `pin_test` on the same server (under
#: xdist, each worker its own: `pin_test_gw0`, …).
BASE_TEST_PG_DSN = os.environ.get(
    "PIN_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/pin_test"
)
TEST_PG_DSN = dsn_with_dbname(BASE_TEST_PG_DSN, per_worker(dbname(BASE_TEST_PG_DSN)))

CHESSBOARD_TABLES = (
    "property_objects",
    "layouts",
    "layout_groups",
    "buildings",
    "projects",
    "project_recalc_requests",
    "recalc_pending_claim_ends",
    "outbox_events",
)


def use_test_database() -> None:
    """PIN_PG_DSN of this process (and of every process a test starts) is the test database."""
    os.environ["PIN_PG_DSN"] = TEST_PG_DSN


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
