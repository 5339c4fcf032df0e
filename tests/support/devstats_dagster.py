"""The dev-stats loader in Dagster, for the tests that run its jobs in process: a run's config
(`load_config`), a materialization's metadata, and the `private_topic` fixture, which aims the
sensor, the backfill job and the asset at a topic and group of the test's own.

Registered for every test by `pytest_plugins` in tests/conftest.py (the fixture does nothing until
a test takes it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from pin_pipelines.defs.devstats import assets as devstats_assets
from pin_pipelines.defs.devstats import jobs as devstats_jobs
from pin_pipelines.defs.devstats import sensors as devstats_sensors
from pin_pipelines.devstats import freshness, loader
from pin_pipelines.devstats.loader import LoadOptions


def load_config(budget: float) -> dict[str, Any]:
    """A short run: the load is continuous, the run ends at its budget."""
    return {"ops": {"dim_layout_group": {"config": {"budget_seconds": budget}}}}


def metadata_of(event: Any) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in event.metadata.items()}


@pytest.fixture
def private_topic(
    chdb_url: str,
    kafka_bootstrap: str,
    pg_dsn: str,
    loader_options: LoadOptions,
    monkeypatch: pytest.MonkeyPatch,
) -> LoadOptions:
    """The sensor and the backfill job aimed at a topic and group of this test alone."""
    monkeypatch.setenv("PIN_CLICKHOUSE_URL", chdb_url)
    monkeypatch.setattr(
        devstats_sensors,
        "unloaded_events",
        functools.partial(
            freshness.unloaded_events, topic=loader_options.topic, group=loader_options.group
        ),
    )
    monkeypatch.setattr(
        devstats_jobs, "backfill", functools.partial(loader.backfill, options=loader_options)
    )
    aimed = functools.partial(
        dataclasses.replace,
        topic=loader_options.topic,
        group=loader_options.group,
        dlq_topic=loader_options.dlq_topic,
    )
    monkeypatch.setattr(
        devstats_assets,
        "load_continuously",
        lambda settings, options: loader.load_continuously(settings, aimed(options)),
    )
    return loader_options
