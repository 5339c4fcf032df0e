"""Outbox relay against the real PostgreSQL and Kafka (issue 4).

Every test captures the topics' end offsets first and reads only from there, and only the keys it
made, so tests (and other modules publishing on the same topics) cannot see each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from psycopg.types.json import Jsonb

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT
from pin_pipelines.relay import OutboxRelay, RelaySummary, relay_lag, relay_once, topic_counters
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.relay.producer import Failure
from pin_pipelines.stack.kafka import LocalKafka

TOPICS = [TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP]
ENVELOPE = ["ContractVersion", "EventId", "CreatedAt", "Id", "Version"]
CONTRACT_FIELDS = {  # contract section 4
    TOPIC_PROJECT: [*ENVELOPE, "TenantId", "Name", "Status", "PriceMin", "PriceMax",
                    "PropertyObjectsTotalCount", "PropertyObjectsFreeCount"],
    TOPIC_LAYOUT: [*ENVELOPE, "ProjectId", "LayoutGroupId", "TotalArea", "PropertyObjectsCount"],
    TOPIC_LAYOUT_GROUP: [*ENVELOPE, "ProjectId", "TenantId", "Name", "SortOrder", "IsArchived",
                         "LayoutsCount", "AreaMin", "AreaMax"],
}  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def payload(topic: str, key: str, version: int, **fields: Any) -> dict[str, Any]:
    """A snapshot event as the recalc writes it (jsonb_build_object of the contract fields)."""
    entity: dict[str, Any] = {
        TOPIC_PROJECT: {
            "TenantId": str(uuid.uuid4()), "Name": "ЖК Северный", "Status": "Published",
            "PriceMin": 5250000.5, "PriceMax": None, "PropertyObjectsTotalCount": 12,
            "PropertyObjectsFreeCount": 3,
        },
        TOPIC_LAYOUT: {
            "ProjectId": str(uuid.uuid4()), "LayoutGroupId": None, "Name": "2К-54",
            "TotalArea": 54.3, "PropertyObjectsCount": 7,
        },
        TOPIC_LAYOUT_GROUP: {
            "ProjectId": str(uuid.uuid4()), "TenantId": str(uuid.uuid4()), "Name": "Студии",
            "SortOrder": 2, "IsArchived": False, "LayoutsCount": 4, "AreaMin": 21.5,
            "AreaMax": None,
        },
    }[topic]  # fmt: skip
    envelope: dict[str, Any] = {
        "ContractVersion": 1,
        "EventId": str(uuid.uuid4()),
        "CreatedAt": "2025-01-31T10:20:30.123Z",
        "Id": key,
        "Version": version,
    }
    return envelope | entity | fields


def insert(conn: psycopg.Connection, rows: list[tuple[str, str, Any]]) -> list[int]:
    """(topic, message_key, payload) rows in this order; returns their outbox ids."""
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
            " VALUES (%s, %s, %s) RETURNING id",
            [(t, k, Jsonb(p)) for t, k, p in rows],
            returning=True,
        )
        ids = []
        while True:
            ids.append(cur.fetchone()[0])  # type: ignore[index]
            if not cur.nextset():
                return ids


def outbox_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()[0]  # type: ignore[index]


def consume(
    bootstrap: str, start: dict[str, dict[int, int]], keys: set[str]
) -> list[tuple[str, str, bytes]]:
    """(topic, key, value) of `keys` between `start` and the current end, in partition order."""
    end = end_offsets(bootstrap, list(start))
    remaining = {
        (t, p): end[t][p] for t, parts in start.items() for p, o in parts.items() if end[t][p] > o
    }
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-relay-{uuid.uuid4()}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(t, p, start[t][p]) for t, p in remaining])
    found: list[tuple[str, str, bytes]] = []
    deadline = time.monotonic() + 30
    try:
        while remaining and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=1):
                assert msg.error() is None, msg.error()
                topic, key, value = str(msg.topic()), bytes(msg.key() or b"").decode(), msg.value()
                if key in keys:
                    found.append((topic, key, bytes(value or b"")))
                tp = (topic, int(msg.partition() or 0))
                if int(msg.offset() or 0) + 1 >= remaining.get(tp, 0):
                    remaining.pop(tp, None)
    finally:
        consumer.close()
    assert not remaining, f"did not reach the end offsets of {remaining}"
    return found


@pytest.fixture
def start(outbox: psycopg.Connection, kafka_bootstrap: str) -> dict[str, dict[int, int]]:
    """End offsets before the test: what the test reads from."""
    return end_offsets(kafka_bootstrap, TOPICS)


def test_payload_shape_key_counters_and_lag(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    rows = [(t, k, payload(t, k, 3)) for t, k in ((t, str(uuid.uuid4())) for t in TOPICS)]
    insert(outbox, rows)
    before = topic_counters(outbox)
    time.sleep(0.3)
    lag = relay_lag(outbox)
    assert lag["pending"] == 3 and lag["lag_seconds"] >= 0.3

    summary = relay_once(Settings.from_env())

    assert summary.published == 3 and summary.dead_lettered == 0
    assert summary.published_by_topic == {t: 1 for t in TOPICS}
    assert summary.pending == 0 and summary.lag_seconds == 0
    as_json = json.loads(json.dumps(summary.as_dict()))
    assert as_json["published"] == 3
    assert outbox_count(outbox) == 0
    assert relay_lag(outbox) == {"pending": 0, "lag_seconds": 0.0}
    after = topic_counters(outbox)
    for topic in TOPICS:
        assert after[topic]["published"] - before.get(topic, {}).get("published", 0) == 1

    sent = {key: (topic, body) for topic, key, body in rows}
    messages = consume(kafka_bootstrap, start, set(sent))
    assert len(messages) == 3
    for topic, key, value in messages:
        assert topic == sent[key][0]
        text = value.decode("utf-8")
        assert "\n" not in text
        event = json.loads(text)
        assert event == sent[key][1]  # numbers stay numbers, absent bounds stay null
        assert event["Id"] == key == key.lower()
        assert set(CONTRACT_FIELDS[topic]) <= set(event)
    names = {json.loads(v)["Name"] for _, _, v in messages}
    assert "ЖК Северный" in names  # UTF-8 on the wire, not escaped


def test_sequence_gap_lower_id_committed_later_is_not_lost(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], pg_dsn: str, kafka_bootstrap: str
) -> None:
    late_key, early_key = str(uuid.uuid4()), str(uuid.uuid4())
    with psycopg.connect(pg_dsn) as slow:  # takes the lower id, commits last
        (late_id,) = insert(slow, [(TOPIC_LAYOUT, late_key, payload(TOPIC_LAYOUT, late_key, 1))])
        (early_id,) = insert(
            outbox, [(TOPIC_LAYOUT, early_key, payload(TOPIC_LAYOUT, early_key, 1))]
        )
        assert late_id < early_id

        first = relay_once(Settings.from_env())
        assert first.published == 1  # the higher id, while the lower one is still uncommitted
        slow.commit()

    second = relay_once(Settings.from_env())
    assert second.published == 1
    assert outbox_count(outbox) == 0
    keys = [key for _, key, _ in consume(kafka_bootstrap, start, {late_key, early_key})]
    assert sorted(keys) == sorted([early_key, late_key])  # each once: nothing lost, no repeat


RELAY_SCRIPT = """
import json, sys, time
from pathlib import Path
from pin_pipelines.config import Settings
from pin_pipelines.relay import relay_once
go = Path(sys.argv[1])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
print(json.dumps(relay_once(Settings.from_env(), batch_size=25).as_dict()), flush=True)
"""


def test_per_key_version_order_with_two_concurrent_relays(
    outbox: psycopg.Connection,
    start: dict[str, dict[int, int]],
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    keys = [str(uuid.uuid4()) for _ in range(60)]
    versions = 20
    # Version-major: consecutive ids belong to different keys, as in a busy drain.
    insert(
        outbox,
        [
            (TOPIC_LAYOUT_GROUP, k, payload(TOPIC_LAYOUT_GROUP, k, v))
            for v in range(1, versions + 1)
            for k in keys
        ],
    )
    go = tmp_path / "go"
    relays = [
        subprocess.Popen(
            [sys.executable, "-c", RELAY_SCRIPT, str(go)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    for relay in relays:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
    go.touch()  # both start together
    summaries = []
    for relay in relays:
        out, _ = relay.communicate(timeout=120)
        assert relay.returncode == 0, out
        summaries.append(json.loads(out.strip().splitlines()[-1]))

    assert sum(s["published"] for s in summaries) == len(keys) * versions
    assert all(s["published"] > 0 for s in summaries), summaries  # they really ran together
    assert outbox_count(outbox) == 0
    seen: dict[str, list[int]] = {k: [] for k in keys}
    for _, key, value in consume(kafka_bootstrap, start, set(keys)):
        seen[key].append(json.loads(value)["Version"])
    assert all(v == list(range(1, versions + 1)) for v in seen.values()), seen


KILLABLE_SCRIPT = """
import time
from pin_pipelines.config import Settings
from pin_pipelines.relay import relay_once

def stall():
    print("flushed", flush=True)
    time.sleep(120)

relay_once(Settings.from_env(), on_flushed=stall)
"""


def test_kill_9_between_send_and_delete_duplicates_but_loses_nothing(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    keys = [str(uuid.uuid4()) for _ in range(30)]
    insert(outbox, [(TOPIC_PROJECT, k, payload(TOPIC_PROJECT, k, 1)) for k in keys])
    relay = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert relay.stdout is not None and relay.stdout.readline().strip() == "flushed"
    os.kill(relay.pid, signal.SIGKILL)
    relay.wait(timeout=10)

    assert outbox_count(outbox) == len(keys)  # acknowledged by Kafka, but never deleted
    assert sorted(k for _, k, _ in consume(kafka_bootstrap, start, set(keys))) == sorted(keys)

    summary = relay_once(Settings.from_env())
    assert summary.published == len(keys)
    assert outbox_count(outbox) == 0
    delivered = [k for _, k, _ in consume(kafka_bootstrap, start, set(keys))]
    assert sorted(delivered) == sorted(keys * 2)  # at-least-once: each twice, none lost


def test_broker_down_keeps_events_and_publishes_them_when_back(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    settings = Settings.from_env()
    kafka = LocalKafka(settings)
    warm = str(uuid.uuid4())
    keys = [str(uuid.uuid4()) for _ in range(20)]
    with OutboxRelay(settings, delivery_timeout=5) as relay:
        insert(outbox, [(TOPIC_LAYOUT, warm, payload(TOPIC_LAYOUT, warm, 1))])
        assert relay.run_once().published == 1  # its producer is connected when the broker dies
        insert(outbox, [(TOPIC_LAYOUT, k, payload(TOPIC_LAYOUT, k, 1)) for k in keys])
        kafka.down()
        try:
            with pytest.raises(PinError) as mid_run:
                relay.run_once()
            assert outbox_count(outbox) == len(keys)
            with pytest.raises(PinError) as fresh:
                relay_once(settings)
            assert outbox_count(outbox) == len(keys)
        finally:
            kafka.up()
        for error in (mid_run.value, fresh.value):
            assert str(error).startswith(f"Kafka at {kafka_bootstrap} ")
            assert "\n" not in str(error)
        assert "timed out" in str(mid_run.value) and "unreachable" in str(fresh.value)

        assert relay.run_once().published == len(keys)  # the same relay, after the outage
    assert outbox_count(outbox) == 0
    delivered = {k for _, k, _ in consume(kafka_bootstrap, start, {warm, *keys})}
    assert delivered == {warm, *keys}


def test_malformed_and_oversized_rows_are_dead_lettered_without_blocking(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    key, other = str(uuid.uuid4()), str(uuid.uuid4())
    missing_version = payload(TOPIC_LAYOUT_GROUP, other, 1)
    del missing_version["Version"]  # the envelope: checked when the row is written
    missing_area = payload(TOPIC_LAYOUT_GROUP, other, 1)
    del missing_area["AreaMin"]  # the topic's own fields: checked against the registry
    not_hex = "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz"  # 36 lowercase characters, no UUID
    bad = [  # (what the error must say, the row)
        ("unknown topic", ("pin.chessboard.nope.v1", other, payload(TOPIC_LAYOUT_GROUP, other, 1))),
        ("not an object", (TOPIC_LAYOUT_GROUP, other, [1, 2])),
        ("payload misses Version", (TOPIC_LAYOUT_GROUP, other, missing_version)),
        ("payload misses AreaMin", (TOPIC_LAYOUT_GROUP, other, missing_area)),
        ("Version is not a positive integer", (
            TOPIC_LAYOUT_GROUP, other, payload(TOPIC_LAYOUT_GROUP, other, 1, Version="7"),
        )),
        ("ContractVersion is not 1", (
            TOPIC_LAYOUT_GROUP, other, payload(TOPIC_LAYOUT_GROUP, other, 1, ContractVersion=2),
        )),
        ("ContractVersion is not 1", (  # equal to 1 as jsonb, but it would be sent as 1.0
            TOPIC_LAYOUT_GROUP, other, payload(TOPIC_LAYOUT_GROUP, other, 1, ContractVersion=1.0),
        )),
        ("message_key differs from payload Id", (
            TOPIC_LAYOUT_GROUP, other, payload(TOPIC_LAYOUT_GROUP, key, 1),
        )),
        ("message_key is not a lowercase UUID", (
            TOPIC_LAYOUT_GROUP, other.upper(), payload(TOPIC_LAYOUT_GROUP, other.upper(), 1),
        )),
        ("message_key is not a lowercase UUID", (
            TOPIC_LAYOUT_GROUP, not_hex, payload(TOPIC_LAYOUT_GROUP, not_hex, 1),
        )),
        ("exceeds", (
            TOPIC_LAYOUT_GROUP, key, payload(TOPIC_LAYOUT_GROUP, key, 2, Name="x" * 1_100_000),
        )),
    ]  # fmt: skip
    good = [(TOPIC_LAYOUT_GROUP, key, payload(TOPIC_LAYOUT_GROUP, key, v)) for v in (1, 3)]
    ids = insert(outbox, [good[0], *(row for _, row in bad), good[1]])
    before = topic_counters(outbox).get(TOPIC_LAYOUT_GROUP, {}).get("dead_lettered", 0)

    summary = relay_once(Settings.from_env())

    assert summary.published == 2
    assert summary.dead_lettered == len(bad)
    assert summary.dead_lettered_by_topic == {
        TOPIC_LAYOUT_GROUP: len(bad) - 1,
        "pin.chessboard.nope.v1": 1,
    }
    assert outbox_count(outbox) == 0
    letters = outbox.execute(
        "SELECT id, error FROM chessboard.outbox_dead_letters ORDER BY id"
    ).fetchall()
    assert [i for i, _ in letters] == ids[1:-1]
    for (_, error), (expected, _) in zip(letters, bad, strict=True):
        assert expected in error
    counters = topic_counters(outbox)
    assert counters[TOPIC_LAYOUT_GROUP]["dead_lettered"] - before == len(bad) - 1
    versions = [json.loads(v)["Version"] for _, _, v in consume(kafka_bootstrap, start, {key})]
    assert versions == [1, 3]


def test_a_row_edited_in_the_outbox_is_sent_and_checked_as_edited(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    """The value sent and the checks are stored with the row (migration 0005); an operator's
    UPDATE of the payload (fixing or breaking it) must change both, never send the old bytes."""
    fixed, broken = str(uuid.uuid4()), str(uuid.uuid4())
    ids = insert(
        outbox,
        [
            (TOPIC_LAYOUT_GROUP, fixed, payload(TOPIC_LAYOUT_GROUP, fixed, 1, ContractVersion=2)),
            (TOPIC_LAYOUT_GROUP, broken, payload(TOPIC_LAYOUT_GROUP, broken, 1)),
        ],
    )
    outbox.execute(
        "UPDATE chessboard.outbox_events SET payload = payload || %s WHERE id = %s",
        (Jsonb({"ContractVersion": 1, "Name": "исправлено"}), ids[0]),
    )
    outbox.execute(
        "UPDATE chessboard.outbox_events SET payload = payload - 'Version' WHERE id = %s",
        (ids[1],),
    )

    summary = relay_once(Settings.from_env())

    assert (summary.published, summary.dead_lettered) == (1, 1)
    [(_, _, value)] = consume(kafka_bootstrap, start, {fixed, broken})
    assert json.loads(value)["Name"] == "исправлено"
    [(error,)] = outbox.execute(
        "SELECT error FROM chessboard.outbox_dead_letters WHERE id = %s", (ids[1],)
    ).fetchall()
    assert error == "payload misses Version"


def test_settling_a_batch_with_failures_keeps_failed_keys_and_dead_letters_refusals(
    outbox: psycopg.Connection,
) -> None:
    """What the relay does with a batch's failure reports. The broker really receives the batch;
    the two failures are made up, since a timed-out delivery of one key and a refusal of another
    cannot be provoked on demand: every event of the key with a retryable failure stays in the
    outbox, also those acknowledged before and after it (so the retry sends them in order); the
    refused event is dead-lettered with Kafka's reason; everything else is deleted and counted."""
    retried, refused, fine = (str(uuid.uuid4()) for _ in range(3))
    rows = [
        (TOPIC_LAYOUT_GROUP, retried, payload(TOPIC_LAYOUT_GROUP, retried, v)) for v in (1, 2, 3)
    ]
    rows += [(TOPIC_LAYOUT_GROUP, k, payload(TOPIC_LAYOUT_GROUP, k, 1)) for k in (refused, fine)]
    ids = insert(outbox, rows)
    before = topic_counters(outbox).get(TOPIC_LAYOUT_GROUP, {}).get("published", 0)

    with OutboxRelay(Settings.from_env()) as relay:
        conn = relay._connection()
        with conn.transaction():
            buckets = relay._claim_buckets(conn, list(range(16)), max(ids))
            sender = relay._sender_for(conn)
            batch = relay._stream(conn, buckets, max(ids), sender)
            assert sender.wait() == []
            value = {(r[2], json.loads(r[3])["Version"]): r[3] for r in batch.sent}
            failures = [
                Failure(KafkaError(KafkaError._MSG_TIMED_OUT), retried, value[retried, 2]),
                Failure(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), refused, value[refused, 1]),
            ]
            kept, error = relay._settle(conn, batch, failures, RelaySummary())

    assert kept == 3 and "timed out" in error
    left = outbox.execute("SELECT id FROM chessboard.outbox_events ORDER BY id").fetchall()
    assert [i for (i,) in left] == ids[:3]
    [(letter_id, letter_error)] = outbox.execute(
        "SELECT id, error FROM chessboard.outbox_dead_letters"
    ).fetchall()
    assert letter_id == ids[3] and letter_error.startswith("Kafka refused the event: ")
    assert topic_counters(outbox)[TOPIC_LAYOUT_GROUP]["published"] - before == 1
