"""Spec 003 in Dagster, in process against the real Kafka and the session's embedded ClickHouse:
the `dim_layout_group` asset (a long-lived continuous load per run) and its metadata, its clean
stop on a cancel and on `pin serve` stopping, the freshness check, the sensor and the backfill job.

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
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from confluent_kafka import Producer
from dagster._core.events import DagsterEvent, DagsterEventType

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.definitions import defs
from pin_pipelines.defs.devstats import jobs as devstats_jobs
from pin_pipelines.defs.devstats import sensors as devstats_sensors
from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.devstats.checks import dim_layout_group_fresh
from pin_pipelines.defs.devstats.jobs import dim_layout_group_backfill_job, dim_layout_group_job
from pin_pipelines.defs.devstats.sensors import dim_layout_group_sensor
from pin_pipelines.defs.handover import HANDOVER_SECONDS
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.defs.stopping import STOPPING_MARKER
from pin_pipelines.devstats import freshness, loader, offsets
from pin_pipelines.devstats.dim import groups, labels
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.devstats.offsets import DEFAULT_GROUP
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, ensure_topics
from tests.support.devstats import (
    Group,
    commit_group,
    committed,
    end_offsets,
    physical_rows,
    produce_events,
)
from tests.support.devstats_dagster import load_config, metadata_of

METADATA_KEYS = {"consumed", "inserted", "skipped_stale", "dead_lettered", "consumer_lag"}
FRESHNESS_KEYS = {"freshness_p50_seconds", "freshness_p99_seconds", "freshness_max_seconds"}


# --- helpers ----------------------------------------------------------------------------------


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
        [dim_layout_group, dim_layout_group_fresh],
        resources=RESOURCES,
        run_config=load_config(budget=3.0),
        raise_on_error=False,
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("dim_layout_group")
    metadata = metadata_of(materialization)
    assert metadata.keys() >= METADATA_KEYS | FRESHNESS_KEYS
    # Produced before the run: visible within its 3 seconds (and a run's start-up).
    assert 0 < metadata["freshness_p50_seconds"] <= metadata["freshness_p99_seconds"] < 60
    assert 2.5 <= metadata["seconds"] < 10
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

    # The check without a load, as its 5-minute schedule runs it (also while loads fail or
    # stop), in one run with Dagster's freshness check of the asset (test_dimension_freshness).
    schedule = defs.resolve_schedule_def("dim_layout_group_fresh_schedule")
    assert schedule.job_name == "dim_layout_group_fresh_check_job"
    only_check = defs.resolve_job_def(schedule.job_name).execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in only_check.get_asset_check_evaluations()}
    assert set(evaluations) == {"dim_layout_group_fresh", "freshness_check"}
    check = evaluations["dim_layout_group_fresh"]
    assert not check.passed
    facts = metadata_of(check)
    assert facts["unloaded_events"] >= 1
    assert facts["oldest_unloaded_age_seconds"] >= 600
    assert not only_check.asset_materializations_for_node("dim_layout_group")

    loaded = dg.materialize(
        [dim_layout_group, dim_layout_group_fresh],
        resources=RESOURCES,
        run_config=load_config(budget=2.0),
    )
    [check] = loaded.get_asset_check_evaluations()
    assert check.passed
    with open_clickhouse(chdb_url) as ch:
        assert labels(ch, group.developer_id, [group.id]) == {str(group.id): "Студии v1"}


# --- a long-lived run stops cleanly -----------------------------------------------------------


def run_until_loaded(
    instance: dg.DagsterInstance,
    chdb_url: str,
    group: Group,
    then: Callable[[str], None],
) -> tuple[dg.ExecuteInProcessResult, float]:
    """The load job in process with a 120 s budget; once `group` is visible, `then(run_id)` (from
    another thread). The result and how long the run took."""
    run_id = str(uuid.uuid4())

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open_clickhouse(chdb_url) as ch:
                if labels(ch, group.developer_id, [group.id])[str(group.id)] != str(group.id):
                    then(run_id)
                    return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        result = defs.resolve_job_def(dim_layout_group_job.name).execute_in_process(
            run_config=load_config(budget=120.0),
            instance=instance,
            run_id=run_id,
            raise_on_error=False,
        )
    finally:
        watcher.join()
    return result, time.monotonic() - started


def test_a_canceled_load_run_commits_the_batch_in_hand_and_keeps_its_summary(
    private_topic: LoadOptions, chdb_url: str, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    """Tried: a run canceled the way Dagster cancels one (its status CANCELING, then SIGINT to
    its main thread) once its first events are in the dimension. The run stops within seconds,
    not at its 120 s budget; it ends CANCELED, with its summary materialized; every offset is
    committed."""
    first = Group()
    produce_events(kafka_bootstrap, private_topic.topic, [first.event(1), Group().event(1)])

    def cancel(run_id: str) -> None:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        instance.report_run_canceling(run)
        os.kill(os.getpid(), signal.SIGINT)

    result, took = run_until_loaded(instance, chdb_url, first, cancel)
    assert took < 30
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.CANCELED
    [materialization] = result.asset_materializations_for_node("dim_layout_group")
    assert metadata_of(materialization)["inserted"] == 2
    ends = end_offsets(kafka_bootstrap, private_topic.topic)
    assert committed(kafka_bootstrap, private_topic.topic, private_topic.group) == ends


def test_a_load_run_ends_when_pin_serve_stops(
    private_topic: LoadOptions, chdb_url: str, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    """Tried: `pin serve`'s stopping marker written while a run loads. The run ends within
    seconds, successfully, with its summary; every offset is committed."""
    group = Group()
    produce_events(kafka_bootstrap, private_topic.topic, [group.event(1), group.event(2)])

    def stopping(_run_id: str) -> None:
        (Path(instance.root_directory) / STOPPING_MARKER).touch()

    result, took = run_until_loaded(instance, chdb_url, group, stopping)
    assert took < 30
    assert result.success
    [materialization] = result.asset_materializations_for_node("dim_layout_group")
    assert metadata_of(materialization)["inserted"] == 1
    ends = end_offsets(kafka_bootstrap, private_topic.topic)
    assert committed(kafka_bootstrap, private_topic.topic, private_topic.group) == ends


# --- the sensor -----------------------------------------------------------------------------


def evaluate(instance: dg.DagsterInstance) -> dg.RunRequest | dg.SkipReason:
    result = dim_layout_group_sensor(
        dg.build_sensor_context(instance=instance, resources=RESOURCES)
    )
    assert isinstance(result, dg.RunRequest | dg.SkipReason), result
    return result


def started_run(instance: dg.DagsterInstance, budget: float) -> str:
    """A load run in flight that started just now, with this budget."""
    job = defs.resolve_job_def(dim_layout_group_job.name)
    run = instance.create_run_for_job(
        job_def=job, run_config=load_config(budget), status=dg.DagsterRunStatus.STARTED
    )
    instance.report_dagster_event(
        DagsterEvent(DagsterEventType.RUN_START.value, job_name=run.job_name), run_id=run.run_id
    )
    return run.run_id


def cancel_all(instance: dg.DagsterInstance) -> None:
    for record in instance.get_run_records():
        instance.report_run_canceled(record.dagster_run)


def test_sensor_keeps_one_load_run_going_and_launches_its_successor_near_its_end(
    private_topic: LoadOptions, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    """Tried: no load run, with the topic up to date and then with events waiting (the loader is
    continuous: it must be running when the first event after a quiet hour comes, so it is
    launched either way); finished runs; a run that just started with the default 5-minute
    budget; one whose budget ends within the hand-over margin; and both. The sensor launches in
    the first cases, skips while a run is in flight, launches the successor (tagged with the run
    it takes over from) near the end, and skips once both are in flight. On chdb
    (PIN_DEVSTATS_MAX_LOAD_RUNS is 1 there) a backlog launches no second load."""
    up_to_date = evaluate(instance)
    assert isinstance(up_to_date, dg.RunRequest)
    assert up_to_date.tags["pin/unloaded_events"] == "0"
    # Each run gets the budget of PIN_LONG_RUN_SECONDS (default 600 s).
    assert up_to_date.run_config == load_config(budget=600.0)

    produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1), Group().event(1)])
    request = evaluate(instance)
    assert isinstance(request, dg.RunRequest)
    assert request.tags["pin/unloaded_events"] == "2"

    job = defs.resolve_job_def(dim_layout_group_job.name)
    for status in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE):
        instance.create_run_for_job(job_def=job, status=status)
    assert isinstance(evaluate(instance), dg.RunRequest)  # finished runs are not in flight

    started_run(instance, budget=300.0)
    busy = evaluate(instance)
    assert isinstance(busy, dg.SkipReason)
    assert "1 load(s) already queued or running" in (busy.skip_message or "")

    cancel_all(instance)
    ending = started_run(instance, budget=HANDOVER_SECONDS)
    successor = evaluate(instance)
    assert isinstance(successor, dg.RunRequest)
    assert successor.tags["pin/takes_over_from"] == ending

    started_run(instance, budget=300.0)
    both = evaluate(instance)
    assert isinstance(both, dg.SkipReason)


def test_sensor_adds_a_load_for_a_backlog_on_a_server_up_to_the_limit(
    private_topic: LoadOptions,
    clickhouse_server_url: str,
    kafka_bootstrap: str,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PIN_DEVSTATS_MAX_LOAD_RUNS=2 on a ClickHouse server, the backlog threshold lowered to 3
    events. Tried: one run in flight with 2 events waiting, then 3; then two runs. The sensor
    adds a second load only for the backlog, and none past the limit."""
    monkeypatch.setenv("PIN_CLICKHOUSE_URL", clickhouse_server_url)
    monkeypatch.setenv("PIN_DEVSTATS_MAX_LOAD_RUNS", "2")
    monkeypatch.setattr(devstats_sensors, "BACKLOG_EVENTS", 3)
    started_run(instance, budget=300.0)
    produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1), Group().event(1)])
    assert isinstance(evaluate(instance), dg.SkipReason)
    produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1)])
    extra = evaluate(instance)
    assert isinstance(extra, dg.RunRequest)
    assert "pin/takes_over_from" not in extra.tags
    started_run(instance, budget=300.0)
    full = evaluate(instance)
    assert isinstance(full, dg.SkipReason)
    assert "2 load(s) already queued or running" in (full.skip_message or "")


def test_sensor_reads_no_consumer_lag_while_a_load_run_stays(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: a load run that just started (the state of every tick but the hand-over's) with
    Kafka unreachable. The tick decides without the lag (it only tags a run the sensor launches,
    or asks for a second one when more than one is allowed): no consumer is made every 5 s."""
    monkeypatch.setenv("PIN_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    started_run(instance, budget=300.0)
    result = evaluate(instance)
    assert isinstance(result, dg.SkipReason)
    assert result.skip_message == "1 load(s) already queued or running"


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


def backfill_run(instance: dg.DagsterInstance, **config: Any) -> dg.ExecuteInProcessResult:
    return dim_layout_group_backfill_job.execute_in_process(
        run_config={"ops": {"replay_layout_group_topic": {"config": config}}},
        resources=RESOURCES,
        instance=instance,
        raise_on_error=False,
    )


def test_backfill_job_needs_confirm_and_a_good_range_and_replays_idempotently(
    private_topic: LoadOptions,
    chdb_url: str,
    kafka_bootstrap: str,
    instance: dg.DagsterInstance,
) -> None:
    """Refused without confirm or with a bad range, before it moves the group; a whole replay,
    then one from the second group's id on (half-open: the others are read, not inserted)."""
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(3)]
    events = [g.event(v) for g in history for v in (1, 2)] + [history[0].event(3, IsArchived=True)]
    produce_events(kafka_bootstrap, private_topic.topic, events)
    assert loader.load_once(Settings.from_env(), private_topic).inserted == 3  # the regular load
    with open_clickhouse(chdb_url) as ch:
        ch.command("OPTIMIZE TABLE pin_dev_stats.dim_layout_group FINAL")
        before = (groups(ch, developer), [physical_rows(ch, g.id) for g in history])
    offsets = committed(kafka_bootstrap, private_topic.topic, private_topic.group)

    low, high = str(uuid.UUID(int=1)), str(uuid.UUID(int=2))
    refusals: list[tuple[dict[str, Any], str]] = [
        ({}, "confirm: true"),
        ({"confirm": False}, "confirm: true"),
        ({"confirm": True, "to_id": "Студии"}, "to_id is not a UUID: 'Студии'"),
        ({"confirm": True, "from_id": high, "to_id": low}, f"from-id {high} is greater than"),
    ]
    for config, why in refusals:
        refused = backfill_run(instance, **config)
        assert not refused.success
        [failure] = [e for e in refused.all_events if e.is_step_failure]
        assert why in str(failure.step_failure_data.error)
        assert committed(kafka_bootstrap, private_topic.topic, private_topic.group) == offsets

    start = sorted(g.id for g in history)[1]
    outside = sum(uuid.UUID(e["Id"]) < start for e in events)
    for ids, out_of_range in [({}, 0), ({"from_id": str(start)}, outside)]:
        replay = backfill_run(instance, confirm=True, **ids)
        assert replay.success
        [materialization] = replay.asset_materializations_for_node("replay_layout_group_topic")
        assert materialization.asset_key == dim_layout_group.key
        metadata = metadata_of(materialization)
        assert metadata.keys() >= METADATA_KEYS
        assert (metadata["consumed"], metadata["inserted"]) == (7, 0)
        assert (metadata["skipped_stale"], metadata["skipped_out_of_range"]) == (
            7 - out_of_range,
            out_of_range,
        )
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
    result = backfill_run(instance, confirm=True)
    assert result.success
    [materialization] = result.asset_materializations_for_node("replay_layout_group_topic")
    assert metadata_of(materialization)["complete"] is False
    warnings = [e.message or "" for e in instance.all_logs(result.run_id) if e.level == 30]
    assert any("1 events left" in w and "continue the replay" in w for w in warnings), warnings
