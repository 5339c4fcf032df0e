"""ClickHouse fixtures (both paths) and per-test Kafka topics for the dev-stats loader.

Registered from `tests/conftest.py` with `pytest_plugins`. A missing service FAILS the test:
- the embedded engine: one chdb folder per test session, held open for the whole session (chdb
  serves one folder per process, so every in-process chdb user must take `chdb_url`);
- the server: `PIN_TEST_CLICKHOUSE_SERVER_URL` (default the `pin stack up` server on port 9000).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import ClickHouse, ServerAddress, migrate_clickhouse, open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import delete_topics, ensure_topics
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import free_port

SERVER_URL = os.environ.get(
    "PIN_TEST_CLICKHOUSE_SERVER_URL", "clickhouse://default@127.0.0.1:9000/pin_dev_stats"
)


@pytest.fixture(scope="session")
def chdb_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's embedded engine, migrated; this process holds its folder until the end."""
    url = f"chdb://{tmp_path_factory.mktemp('chdb')}"
    with open_clickhouse(url) as ch:
        migrate_clickhouse(ch)
        yield url


@pytest.fixture(scope="session")
def clickhouse_server_url() -> str:
    """The Debian server of the test stack, migrated."""
    try:
        with open_clickhouse(SERVER_URL) as ch:
            migrate_clickhouse(ch)
    except PinError as exc:
        pytest.fail(f"{exc} (start it with `pin stack up` or set PIN_TEST_CLICKHOUSE_SERVER_URL)")
    return SERVER_URL


@pytest.fixture(params=["embedded", "server"])
def clickhouse_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs on both ClickHouse paths."""
    name = "chdb_url" if request.param == "embedded" else "clickhouse_server_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def clickhouse(clickhouse_url: str) -> Iterator[ClickHouse]:
    with open_clickhouse(clickhouse_url) as ch:
        yield ch


@pytest.fixture
def private_clickhouse_server(tmp_path: Path) -> Iterator[LocalClickHouseServer]:
    """A Debian server of this test alone (its own port and state folder), for stop/start tests."""
    server = LocalClickHouseServer(ServerAddress("127.0.0.1", free_port(), "default", ""), tmp_path)
    server.up()
    try:
        yield server
    finally:
        server.down()


def server_url(server: LocalClickHouseServer) -> str:
    return f"clickhouse://default@127.0.0.1:{server.address.port}/pin_dev_stats"


@pytest.fixture
def loader_options(kafka_bootstrap: str) -> Iterator[LoadOptions]:
    """Fresh source and DLQ topics (3 partitions, deleted afterwards) and consumer group, so tests
    never share offsets. Retries are short: an unreachable ClickHouse fails in about a second."""
    suffix = uuid.uuid4().hex[:10]
    options = LoadOptions(
        topic=f"pin.test.layout-group-upserted.{suffix}",
        dlq_topic=f"pin.test.dlq.{suffix}",
        group=f"pin-test-devstats-{suffix}",
        attempts=3,
        backoff_seconds=0.2,
    )
    ensure_topics(kafka_bootstrap, (options.topic, options.dlq_topic))
    yield options
    delete_topics(kafka_bootstrap, (options.topic, options.dlq_topic))


def settings_for(clickhouse_url: str, kafka_bootstrap: str, state_dir: Path) -> Settings:
    return Settings.from_env(
        {
            "PIN_CLICKHOUSE_URL": clickhouse_url,
            "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "PIN_STATE_DIR": str(state_dir),
        }
    )


@pytest.fixture
def loader_settings(clickhouse_url: str, kafka_bootstrap: str, tmp_path: Path) -> Settings:
    return settings_for(clickhouse_url, kafka_bootstrap, tmp_path)
