"""Spec 003's 5-minute freshness SLA as Dagster's own freshness for dim_layout_group
(defs/devstats/freshness.py): the observing sensor records when the dimension was last current,
and the last-update freshness check fails once that is more than 5 minutes ago.

The broker is the session's private one: the sensor reads the product's topic and the loader's
consumer group, which on the shared broker hold every other session's events.
"""

from __future__ import annotations

import json
import time

import dagster as dg
import pytest
from confluent_kafka import Producer

from pin_pipelines.definitions import defs
from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.devstats.freshness import (
    LAST_UPDATED,
    dim_layout_group_last_update_sensor,
)
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.devstats.loading import FRESHNESS_SLA_SECONDS
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, client_config
from pin_pipelines.stack.kafka import LocalKafka
from tests.support.devstats import Group

#: An event that waits unloaded this long is past the SLA by far.
LATE_SECONDS = 2 * FRESHNESS_SLA_SECONDS


def _observe(instance: dg.DagsterInstance) -> dg.AssetObservation:
    """One tick of the observing sensor, its observation recorded as the daemon records it."""
    result = dim_layout_group_last_update_sensor(
        dg.build_sensor_context(instance=instance, resources=RESOURCES)
    )
    assert isinstance(result, dg.SensorResult), result
    [observation] = result.asset_events
    assert isinstance(observation, dg.AssetObservation)
    instance.report_runless_asset_event(observation)
    return observation


def _freshness(instance: dg.DagsterInstance) -> dg.AssetCheckEvaluation:
    """The freshness check, evaluated as its schedule's run evaluates it (with the project's
    topic-based check of the same SLA, dim_layout_group_fresh, in the same run)."""
    schedule = defs.resolve_schedule_def("dim_layout_group_fresh_schedule")
    result = defs.resolve_job_def(schedule.job_name).execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(evaluations) == {"dim_layout_group_fresh", "freshness_check"}
    return evaluations["freshness_check"]


def test_a_dimension_behind_its_sla_shows_as_stale_in_dagster(
    kafka: LocalKafka, pg_instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: the layout-group topic empty (nothing to load: the dimension is current), one
    observing tick, then the freshness check: it passes. Then an event created 10 minutes ago
    waits unloaded (no loader runs), another tick: the observation says the dimension was last
    current 10 minutes ago, and the freshness check, evaluated through Dagster as the UI shows
    it, fails with severity ERROR. Before, the asset had no freshness of Dagster's: only the
    project's own checks said so."""
    bootstrap = kafka.settings.kafka_bootstrap
    monkeypatch.setenv("PIN_KAFKA_BOOTSTRAP", bootstrap)

    current = _observe(pg_instance)
    updated = current.metadata[LAST_UPDATED]
    assert isinstance(updated, dg.TimestampMetadataValue)
    assert updated.value > time.time() - 60
    fresh = _freshness(pg_instance)
    assert fresh.asset_key == dim_layout_group.key and fresh.passed, fresh.metadata

    producer = Producer(client_config(bootstrap))
    event = Group().event(1)
    producer.produce(
        TOPIC_LAYOUT_GROUP,
        key=event["Id"].encode(),
        value=json.dumps(event).encode(),
        timestamp=int((time.time() - LATE_SECONDS) * 1000),
    )
    assert producer.flush(15) == 0

    late = _observe(pg_instance)
    updated = late.metadata[LAST_UPDATED]
    assert isinstance(updated, dg.TimestampMetadataValue)
    assert updated.value < time.time() - FRESHNESS_SLA_SECONDS
    stale = _freshness(pg_instance)
    assert not stale.passed, stale.metadata
    assert stale.severity == dg.AssetCheckSeverity.ERROR
