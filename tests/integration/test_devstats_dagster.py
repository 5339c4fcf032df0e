"""Spec 003 in Dagster, in process against the real Kafka and the session's embedded ClickHouse:
the `dim_layout_group` asset and its metadata, the freshness check, the sensor and the backfill job.

The asset and its check run on the contract's topic and the loader's own consumer group (that is
the wiring under test). The topic is shared with every other test that publishes layout-group
events, so each test first commits the group up to the current end of the topic and then asserts
only on the groups it produced itself. The sensor and backfill tests need an exact lag and a whole
replay, so they point the same code at a topic of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.definitions import defs
from pin_pipelines.defs.devstats import jobs as devstats_jobs
from pin_pipelines.defs.devstats import sensors as devstats_sensors
from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.devstats.checks import dim_layout_group_fresh
from pin_pipelines.defs.devstats.jobs import dim_layout_group_backfill_job, dim_layout_group_job
from pin_pipelines.defs.devstats.sensors import dim_layout_group_sensor
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.devstats import freshness, loader, offsets
from pin_pipelines.devstats.dim import groups, labels
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.devstats.offsets import DEFAULT_GROUP
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, ensure_topics
from tests.support.devstats import Group, committed, physical_rows, produce_events

METADATA_KEYS = {"consumed", "inserted", "skipped_stale", "dead_lettered", "consumer_lag"}


# --- helpers ----------------------------------------------------------------------------------


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}"})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        return {
            p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
            for p in partitions
        }
    finally:
        consumer.close()


def commit_group(bootstrap: str, topic: str, group: str, offsets: dict[int, int]) -> None:
    """Move `group` to `offsets` the way the loader commits (explicit offsets, no membership)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        done = consumer.commit(
            offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False
        )
        assert all(tp.error is None for tp in done or []), done
    finally:
        consumer.close()


def produce_old(
    bootstrap: str, topic: str, event: dict[str, Any], age_seconds: float
) -> tuple[int, int]:
    """Produce one event whose Kafka timestamp lies `age_seconds` in the past; where it went."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    placed: list[tuple[int, int]] = []
    producer.produce(
        topic,
        key=event["Id"].encode(),
        value=json.dumps(event).encode(),
        timestamp=int((time.time() - age_seconds) * 1000),
        on_delivery=lambda err, msg: placed.append((msg.partition(), msg.offset())),
    )
    assert producer.flush(15) == 0 and placed
    return placed[0]


def metadata_of(event: Any) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in event.metadata.items()}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def contract_topic(
    chdb_url: str, kafka_bootstrap: str, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The contract topic with the loader's group committed to its current end: a materialization
    sees only what the test produces next (and what others publish meanwhile)."""
    monkeypatch.setenv("PIN_CLICKHOUSE_URL", chdb_url)
    ensure_topics(kafka_bootstrap, (TOPIC_LAYOUT_GROUP,))
    commit_group(
        kafka_bootstrap,
        TOPIC_LAYOUT_GROUP,
        DEFAULT_GROUP,
        end_offsets(kafka_bootstrap, TOPIC_LAYOUT_GROUP),
    )
    return TOPIC_LAYOUT_GROUP


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
    return loader_options


# --- the asset and its freshness check ------------------------------------------------------


def test_materialization_loads_the_topic_with_its_metadata_and_passes_the_check(
    contract_topic: str, chdb_url: str, kafka_bootstrap: str
) -> None:
    developer = uuid.uuid4()
    first, second = Group(developer_id=developer), Group(developer_id=developer)
    produce_events(
        kafka_bootstrap,
        contract_topic,
        [first.event(1), first.event(2, Name="Студии"), second.event(1), first.event(1)],
    )

    result = dg.materialize(
        [dim_layout_group, dim_layout_group_fresh], resources=RESOURCES, raise_on_error=False
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("dim_layout_group")
    metadata = metadata_of(materialization)
    assert metadata.keys() >= METADATA_KEYS
    # Others may publish on the shared topic meanwhile: at least our four were consumed.
    assert metadata["consumed"] >= 4
    assert metadata["inserted"] >= 2
    assert metadata["skipped_stale"] >= 2  # v1 under v2 in the batch, and the late v1
    assert metadata["dead_lettered"] >= 0
    lag = metadata["consumer_lag"]
    assert set(lag) == {str(p) for p in end_offsets(kafka_bootstrap, contract_topic)}
    assert all(isinstance(n, int) and n >= 0 for n in lag.values())

    with open_clickhouse(chdb_url) as ch:
        assert labels(ch, developer, [first.id, second.id]) == {
            str(first.id): "Студии",
            str(second.id): "Студии v1",
        }
        assert {g.layout_group_id: g.source_version for g in groups(ch, developer)} == {
            first.id: 2,
            second.id: 1,
        }

    [check] = result.get_asset_check_evaluations()
    assert check.check_name == "dim_layout_group_fresh"
    assert check.passed
    assert metadata_of(check)["sla_seconds"] == 300.0


def test_freshness_check_fails_when_an_event_waited_longer_than_the_sla(
    contract_topic: str, chdb_url: str, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    """An event produced 10 minutes ago and not loaded: the check fails (the run does not: a
    check result is a verdict, not an error). Loading it makes the check pass again."""
    group = Group()
    partition, offset = produce_old(
        kafka_bootstrap, contract_topic, group.event(1), age_seconds=600
    )
    # Ours is the first unloaded event of its partition; the other partitions are up to date.
    offsets = end_offsets(kafka_bootstrap, contract_topic) | {partition: offset}
    commit_group(kafka_bootstrap, contract_topic, DEFAULT_GROUP, offsets)

    # The check on its own, as its every-minute schedule runs it (also while loads fail or stop).
    schedule = defs.resolve_schedule_def("dim_layout_group_fresh_schedule")
    assert schedule.job_name == "dim_layout_group_fresh_check_job"
    only_check = defs.resolve_job_def(schedule.job_name).execute_in_process(instance=instance)
    [check] = only_check.get_asset_check_evaluations()
    assert not check.passed
    facts = metadata_of(check)
    assert facts["unloaded_events"] >= 1
    assert facts["oldest_unloaded_age_seconds"] >= 600
    assert not only_check.asset_materializations_for_node("dim_layout_group")

    loaded = dg.materialize([dim_layout_group, dim_layout_group_fresh], resources=RESOURCES)
    [check] = loaded.get_asset_check_evaluations()
    assert check.passed
    with open_clickhouse(chdb_url) as ch:
        assert labels(ch, group.developer_id, [group.id]) == {str(group.id): "Студии v1"}


# --- the sensor -----------------------------------------------------------------------------


def evaluate(instance: dg.DagsterInstance) -> dg.RunRequest | dg.SkipReason:
    result = dim_layout_group_sensor(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.RunRequest | dg.SkipReason), result
    return result


def test_sensor_requests_a_load_on_lag_and_skips_when_up_to_date_or_in_flight(
    private_topic: LoadOptions, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    empty = evaluate(instance)
    assert isinstance(empty, dg.SkipReason)
    assert "up to date" in (empty.skip_message or "")

    produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1), Group().event(1)])
    request = evaluate(instance)
    assert isinstance(request, dg.RunRequest)
    assert request.tags["pin/unloaded_events"] == "2"

    job = defs.resolve_job_def(dim_layout_group_job.name)
    for status in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE):
        instance.create_run_for_job(job_def=job, status=status)
    assert isinstance(evaluate(instance), dg.RunRequest)  # finished runs are not in flight
    instance.create_run_for_job(job_def=job, status=dg.DagsterRunStatus.STARTED)
    busy = evaluate(instance)
    assert isinstance(busy, dg.SkipReason)
    assert "already queued or running" in (busy.skip_message or "")

    commit_group(
        kafka_bootstrap,
        private_topic.topic,
        private_topic.group,
        end_offsets(kafka_bootstrap, private_topic.topic),
    )
    assert isinstance(evaluate(instance), dg.SkipReason)


def test_sensor_skips_with_the_reason_when_kafka_is_unreachable(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str
) -> None:
    monkeypatch.setenv("PIN_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setattr(offsets, "KAFKA_TIMEOUT", 1.0)
    monkeypatch.setattr(freshness, "KAFKA_TIMEOUT", 1.0)
    result = evaluate(instance)
    assert isinstance(result, dg.SkipReason)
    assert "consumer lag unreadable" in (result.skip_message or "")
    assert "127.0.0.1:1" in (result.skip_message or "")


# --- the backfill job -----------------------------------------------------------------------


def backfill_run(instance: dg.DagsterInstance, confirm: bool | None) -> dg.ExecuteInProcessResult:
    config = {} if confirm is None else {"confirm": confirm}
    return dim_layout_group_backfill_job.execute_in_process(
        run_config={"ops": {"replay_layout_group_topic": {"config": config}}},
        resources=RESOURCES,
        instance=instance,
        raise_on_error=False,
    )


def test_backfill_job_needs_confirm_and_replays_idempotently(
    private_topic: LoadOptions,
    chdb_url: str,
    kafka_bootstrap: str,
    instance: dg.DagsterInstance,
) -> None:
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(3)]
    produce_events(
        kafka_bootstrap,
        private_topic.topic,
        [g.event(v) for g in history for v in (1, 2)] + [history[0].event(3, IsArchived=True)],
    )
    assert loader.load_once(Settings.from_env(), private_topic).inserted == 3  # the regular load
    with open_clickhouse(chdb_url) as ch:
        ch.command("OPTIMIZE TABLE pin_dev_stats.dim_layout_group FINAL")
        before = (groups(ch, developer), [physical_rows(ch, g.id) for g in history])
    offsets = committed(kafka_bootstrap, private_topic.topic, private_topic.group)

    for confirm in (None, False):
        refused = backfill_run(instance, confirm)
        assert not refused.success
        [failure] = [e for e in refused.all_events if e.is_step_failure]
        assert "confirm: true" in str(failure.step_failure_data.error)
        assert committed(kafka_bootstrap, private_topic.topic, private_topic.group) == offsets

    for _ in range(2):
        replay = backfill_run(instance, True)
        assert replay.success
        [materialization] = replay.asset_materializations_for_node("replay_layout_group_topic")
        assert materialization.asset_key == dim_layout_group.key
        metadata = metadata_of(materialization)
        assert metadata.keys() >= METADATA_KEYS
        assert (metadata["consumed"], metadata["inserted"], metadata["skipped_stale"]) == (7, 0, 7)
        with open_clickhouse(chdb_url) as ch:
            ch.command("OPTIMIZE TABLE pin_dev_stats.dim_layout_group FINAL")
            assert (groups(ch, developer), [physical_rows(ch, g.id) for g in history]) == before
    archived = {g.layout_group_id: (g.is_archived, g.source_version) for g in before[0]}
    assert archived[history[0].id] == (True, 3)  # archived, still there


def test_backfill_job_bounded_by_time_warns_that_the_replay_continues(
    private_topic: LoadOptions,
    kafka_bootstrap: str,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1)])
    bounded = dataclasses.replace(private_topic, max_seconds=0)
    monkeypatch.setattr(
        devstats_jobs, "backfill", functools.partial(loader.backfill, options=bounded)
    )
    result = backfill_run(instance, True)
    assert result.success
    [materialization] = result.asset_materializations_for_node("replay_layout_group_topic")
    assert metadata_of(materialization)["complete"] is False
    warnings = [e.message or "" for e in instance.all_logs(result.run_id) if e.level == 30]
    assert any("1 events left" in w and "continue the replay" in w for w in warnings), warnings
