"""Fixtures of the integration tests that run the whole pipeline: drain → relay → loader into the
session's embedded dimension."""

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
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP
from pin_pipelines.relay import relay_once
from tests.support.recalc import drain_until_empty

DIM = "pin_dev_stats.dim_layout_group"


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
    monkeypatch.setenv(
        "PIN_DAGSTER_PG_URL", dagster_pg_url_from(dagster_db, dagster_db.rsplit("/", 1)[1])
    )
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance
