"""Fixtures of the integration tests that run the whole pipeline: drain → relay → loader into the
session's embedded dimension."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from pin_pipelines.clickhouse import ClickHouse, open_clickhouse
from pin_pipelines.config import Settings
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
