"""The outbox relay in Dagster, in process against the real PostgreSQL and Kafka: the job
publishes the outbox and records a materialization per topic asset; the sensor launches it only
while the outbox holds events and no relay run is in flight."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import dagster as dg
import psycopg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType

from pin_pipelines.defs.handover import HANDOVER_SECONDS
from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.relay.sensors import outbox_relay_sensor
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP
from pin_pipelines.relay import OutboxRelay
from pin_pipelines.relay import topic_end_offsets as end_offsets
from tests.support.outbox import TOPICS, insert, outbox_count, payload
from tests.support.pg_cost import database_cost
from tests.support.relay import consume, relay_config


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def metadata_of(event: Any) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in event.metadata.items()}


def test_relay_job_publishes_the_outbox_and_materializes_each_topic(
    outbox: psycopg.Connection, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    start = end_offsets(kafka_bootstrap, TOPICS)
    counts = {TOPIC_LAYOUT_GROUP: 3, TOPIC_LAYOUT: 2}  # no project event this time
    rows = [
        (topic, key, payload(topic, key, 1))
        for topic, n in counts.items()
        for key in (str(uuid.uuid4()) for _ in range(n))
    ]
    insert(outbox, rows)

    result = outbox_relay_job.execute_in_process(
        run_config=relay_config(), resources=RESOURCES, instance=instance
    )

    assert result.success
    assert outbox_count(outbox) == 0
    ends = end_offsets(kafka_bootstrap, TOPICS)
    materialized = {
        m.asset_key: metadata_of(m) for m in result.asset_materializations_for_node("relay_outbox")
    }
    # One materialization per topic that got events; none for a topic without any.
    assert set(materialized) == {TOPIC_ASSETS[t].key for t in counts}
    for topic, n in counts.items():
        metadata = materialized[TOPIC_ASSETS[topic].key]
        assert metadata["published"] == n
        assert metadata["dead_lettered"] == 0
        # The topic's end offsets after the run: past this run's n events, not past the end.
        recorded = {int(p): o for p, o in metadata["end_offsets"].items()}
        assert set(recorded) == set(ends[topic]), topic
        assert all(start[topic][p] <= o <= ends[topic][p] for p, o in recorded.items())
        assert sum(o - start[topic][p] for p, o in recorded.items()) >= n

    sent = {key: (topic, body) for topic, key, body in rows}
    received = consume(kafka_bootstrap, start, set(sent))
    assert sorted(key for _, key, _ in received) == sorted(sent)
    for topic, key, value in received:
        assert (topic, json.loads(value)) == sent[key]


def test_relay_job_reports_dead_letters_and_keeps_going(
    outbox: psycopg.Connection, kafka_bootstrap: str, instance: dg.DagsterInstance
) -> None:
    key = str(uuid.uuid4())
    bad = payload(TOPIC_LAYOUT_GROUP, key, 1, ContractVersion=2)
    insert(
        outbox,
        [
            (TOPIC_LAYOUT_GROUP, key, bad),
            (TOPIC_LAYOUT_GROUP, key, payload(TOPIC_LAYOUT_GROUP, key, 2)),
        ],
    )
    result = outbox_relay_job.execute_in_process(
        run_config=relay_config(), resources=RESOURCES, instance=instance
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("relay_outbox")
    assert materialization.asset_key == TOPIC_ASSETS[TOPIC_LAYOUT_GROUP].key
    assert (
        metadata_of(materialization)["published"],
        metadata_of(materialization)["dead_lettered"],
    ) == (1, 1)
    assert outbox_count(outbox) == 0
    warnings = [
        e.message
        for e in instance.all_logs(result.run_id)
        if e.level == 30 and "outbox_dead_letters" in (e.message or "")
    ]
    assert warnings, "the dead letter is reported in the run's log"


def test_relay_job_that_fails_midway_still_materializes_what_it_published(
    outbox: psycopg.Connection,
    kafka_bootstrap: str,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker going away after a first pass: the continuous relay retries until its budget
    ends, the run then fails with the relay's error, and the events it did publish are still
    recorded on their topic asset."""
    key = str(uuid.uuid4())
    insert(outbox, [(TOPIC_LAYOUT_GROUP, key, payload(TOPIC_LAYOUT_GROUP, key, 1))])
    real_run_once, calls = OutboxRelay.run_once, []

    def run_once_then_fail(self: OutboxRelay, should_stop: Any, **options: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise PinError("Kafka at 127.0.0.1:9092 timed out (simulated)")
        return real_run_once(self, should_stop, **options)

    monkeypatch.setattr(OutboxRelay, "run_once", run_once_then_fail)
    result = outbox_relay_job.execute_in_process(
        run_config=relay_config(budget=3.0),
        resources=RESOURCES,
        instance=instance,
        raise_on_error=False,
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert "simulated" in str(failure.step_failure_data.error)
    [materialization] = result.asset_materializations_for_node("relay_outbox")
    assert materialization.asset_key == TOPIC_ASSETS[TOPIC_LAYOUT_GROUP].key
    assert metadata_of(materialization)["published"] == 1
    assert outbox_count(outbox) == 0


# --- the sensor -----------------------------------------------------------------------------


def evaluate(instance: dg.DagsterInstance) -> dg.RunRequest | dg.SkipReason:
    result = outbox_relay_sensor(dg.build_sensor_context(instance=instance, resources=RESOURCES))
    assert isinstance(result, dg.RunRequest | dg.SkipReason), result
    return result


def _started_run(instance: dg.DagsterInstance, budget: float) -> str:
    """A relay run in flight that started just now, with this budget."""
    run = instance.create_run_for_job(
        job_def=outbox_relay_job,
        run_config=relay_config(budget=budget),
        status=dg.DagsterRunStatus.STARTED,
    )
    instance.report_dagster_event(
        DagsterEvent(DagsterEventType.RUN_START.value, job_name=run.job_name), run_id=run.run_id
    )
    return run.run_id


def test_sensor_keeps_one_relay_run_going_and_launches_its_successor_near_its_end(
    outbox: psycopg.Connection, instance: dg.DagsterInstance
) -> None:
    """Tried: no relay run (even with an empty outbox: the relay is continuous, so the first
    event after a quiet hour is published at once), a run that just started with the default
    5-minute budget, and one whose budget ends within the hand-over margin. The sensor launches
    in the first case, skips in the second, launches the successor (tagged with the run it takes
    over from) in the third, and skips once both are in flight."""
    empty = evaluate(instance)
    assert isinstance(empty, dg.RunRequest)
    assert empty.tags["pin/outbox_pending"] == "0"
    # Each run gets the budget of PIN_LONG_RUN_SECONDS (default 600 s).
    assert empty.run_config == {"ops": {"relay_outbox": {"config": {"budget_seconds": 600.0}}}}

    _started_run(instance, budget=300.0)
    busy = evaluate(instance)
    assert isinstance(busy, dg.SkipReason)
    assert "already queued or running" in (busy.skip_message or "")

    for record in instance.get_run_records():
        instance.report_run_canceled(record.dagster_run)
    ending = _started_run(instance, budget=HANDOVER_SECONDS)
    successor = evaluate(instance)
    assert isinstance(successor, dg.RunRequest)
    assert successor.tags["pin/takes_over_from"] == ending

    _started_run(instance, budget=300.0)
    both = evaluate(instance)
    assert isinstance(both, dg.SkipReason)


def test_sensor_reads_nothing_of_the_catalogue_while_a_relay_run_stays(
    pg_dsn: str, instance: dg.DagsterInstance
) -> None:
    """Tried: ten ticks with a relay run that just started (the state of every tick but the
    hand-over's), counted by the server (pg_stat_database of the test database, which nothing
    else uses meanwhile). The backlog only tags a run the sensor launches: no session, no
    statement."""
    _started_run(instance, budget=300.0)
    with database_cost(pg_dsn) as cost:
        for _ in range(10):
            assert isinstance(evaluate(instance), dg.SkipReason)
    assert (cost.sessions, cost.transactions) == (0, 0)


def test_sensor_skips_with_the_reason_when_postgres_is_unreachable(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIN_PG_DSN", "postgresql://postgres@127.0.0.1:1/pin_test")
    result = evaluate(instance)
    assert isinstance(result, dg.SkipReason)
    assert "outbox unreadable" in (result.skip_message or "")
