"""Foundation: the local services and the schema come up idempotently; failures are one line."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, Producer
from psycopg.types.json import Jsonb

from pin_pipelines.kafka import delete_topics
from tests.support.cli import assert_one_line_error, run_pin, summary


def test_stack_up_twice_is_a_no_op() -> None:
    """`pin stack up` on running services starts nothing: every service says it already ran."""
    first = summary(run_pin("stack", "up"))
    second = summary(run_pin("stack", "up"))
    assert [s["service"] for s in first["services"]] == [s["service"] for s in second["services"]]
    assert {s["state"] for s in second["services"]} <= {"already running", "external"}


def test_stack_status_reports_every_service() -> None:
    status = summary(run_pin("stack", "status"))
    states = {s["service"]: s["state"] for s in status["services"]}
    assert states["postgresql"] == "running"
    assert states["kafka"] == "running"


def test_db_migrate_twice_is_a_no_op(pg_dsn: str, tmp_path: Path) -> None:
    """Second migrate applies nothing to PostgreSQL, ClickHouse or Kafka."""
    env = {"PIN_PG_DSN": pg_dsn, "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}"}
    summary(run_pin("db", "migrate", env=env))
    again = summary(run_pin("db", "migrate", env=env))
    assert again["postgres_applied"] == []
    assert again["clickhouse_applied"] == []
    assert again["kafka_topics_created"] == []


def test_kafka_produce_consume_round_trip(kafka_bootstrap: str) -> None:
    """A message through the real broker comes back with its key and value."""
    topic = f"pin.test.roundtrip.{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    producer.produce(topic, key=b"k1", value=b'{"hello": "kafka"}')
    assert producer.flush(15) == 0
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"rt-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    try:
        for _ in range(60):
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                assert (msg.key(), msg.value()) == (b"k1", b'{"hello": "kafka"}')
                return
        raise AssertionError("message did not come back within 30 s")
    finally:
        consumer.close()
        delete_topics(kafka_bootstrap, (topic,))


def test_pin_reports_postgres_down_in_one_line() -> None:
    """Tried: drain, request and migrate against a port where no PostgreSQL listens."""
    env = {"PIN_PG_DSN": "postgresql://postgres@127.0.0.1:1/pin"}
    for args in (
        ("recalc", "drain", "--once"),
        ("recalc", "request", "--project-id", str(uuid.uuid4())),
        ("db", "migrate"),
    ):
        assert_one_line_error(run_pin(*args, env=env), "PostgreSQL", "unreachable")


def test_pin_reports_kafka_down_in_one_line(db: psycopg.Connection) -> None:
    """Tried: the relay with an event to publish, against an address where no broker listens.
    The event stays in the outbox."""
    project_id = str(uuid.uuid4())
    db.execute(
        "INSERT INTO chessboard.outbox_events (topic, message_key, payload) VALUES (%s, %s, %s)",
        (
            "pin.chessboard.project-upserted.v1",
            project_id,
            Jsonb(
                {
                    "ContractVersion": 1,
                    "EventId": str(uuid.uuid4()),
                    "Id": project_id,
                    "Version": 2,
                    "CreatedAt": "2026-11-30T00:00:00.000Z",
                }
            ),
        ),
    )
    env = {"PIN_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    result = run_pin("outbox", "relay", "--once", env=env, timeout=120)
    assert_one_line_error(result, "Kafka")
    (left,) = db.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone() or (0,)
    assert left == 1


def test_pin_rejects_bad_arguments_in_one_line() -> None:
    """Tried: a malformed UUID, a missing required option, an unknown command."""
    assert_one_line_error(run_pin("recalc", "request", "--project-id", "not-a-uuid"), "UUID")
    assert_one_line_error(run_pin("recalc", "requeue"), "--project-id")
    assert_one_line_error(
        run_pin("devstats", "labels", "--developer-id", str(uuid.uuid4()), "--ids", "x"), "UUID"
    )
    assert_one_line_error(run_pin("nonsense"))
