"""Outbox relay against the real PostgreSQL and Kafka.

Every test captures the topics' end offsets first and reads only from there, and only the keys it
made, so tests (and other modules publishing on the same topics) cannot see each other. Reads are
read_committed, as the contract's consumers read. Crashes and broker outages are in
test_relay_exactly_once.py, on a private broker.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME
from confluent_kafka.admin import NewTopic
from psycopg.types.json import Jsonb

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import (
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    TOPIC_PROJECT,
    admin,
    delete_topics,
)
from pin_pipelines.relay import relay_lag, relay_once, topic_counters
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.relay.outbox import Q
from tests.support.contracts import CONTRACT_FIELDS
from tests.support.outbox import TOPICS, insert, outbox_count, payload
from tests.support.relay import consume, consume_messages

ROOT = Path(__file__).resolve().parents[2]


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
    """Two relays started together: the second waits for the first one's lock instead of
    publishing beside it, so each event goes out once and every key's versions in order."""
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
    summaries = []
    try:
        for relay in relays:
            assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        go.touch()  # both start together
        for relay in relays:
            out, _ = relay.communicate(timeout=120)
            assert relay.returncode == 0, out
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for relay in relays:
            relay.kill()
            relay.wait()

    # One publisher at a time: whichever got the lock first published all 25-event batches
    # while the other waited, then found nothing left.
    assert sorted(s["published"] for s in summaries) == [0, len(keys) * versions], summaries
    assert outbox_count(outbox) == 0
    seen: dict[str, list[int]] = {k: [] for k in keys}
    for _, key, value in consume(kafka_bootstrap, start, set(keys)):
        seen[key].append(json.loads(value)["Version"])
    assert all(v == list(range(1, versions + 1)) for v in seen.values()), seen


def test_a_relay_waits_for_the_one_holding_the_outbox_and_gives_up_after_lock_timeout(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], pg_dsn: str, kafka_bootstrap: str
) -> None:
    """Tried: the relay lock held by another session (as a running relay holds it), first past
    a short lock_timeout (one-line error, the event stays), then released while a relay waits
    (it publishes as soon as it gets the lock)."""
    key = str(uuid.uuid4())
    insert(outbox, [(TOPIC_LAYOUT, key, payload(TOPIC_LAYOUT, key, 1))])
    result: dict[str, Any] = {}

    def relay() -> None:
        result["summary"] = relay_once(Settings.from_env(), lock_timeout=60)

    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        Q.lock_relay(holder)
        with pytest.raises(PinError) as busy:
            relay_once(Settings.from_env(), lock_timeout=1)
        assert str(busy.value) == (
            "the outbox stayed locked by another session (a relay?) for over 1s;"
            " run the relay again"
        )
        assert outbox_count(outbox) == 1
        waiting = threading.Thread(target=relay)
        waiting.start()
        try:
            deadline = time.monotonic() + 30
            while not holder.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'pin-outbox-relay' AND wait_event = 'advisory'"
            ).fetchone():
                assert time.monotonic() < deadline, "the relay never waited for the lock"
                time.sleep(0.05)
            assert outbox_count(outbox) == 1
            Q.unlock_relay(holder)
        finally:
            waiting.join(90)
    assert result["summary"].published == 1
    assert [k for _, k, _ in consume(kafka_bootstrap, start, {key})] == [key]


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


def test_the_defect_check_is_one_inlined_expression_with_every_missing_field_named(
    outbox: psycopg.Connection,
) -> None:
    """Tried: EXPLAIN VERBOSE of the check on the outbox's own columns, then rows missing one,
    several and all of the envelope's fields. Written with a sub-SELECT (migration 0005) the check
    was never inlined: each statement writing outbox rows parsed and planned it again at its first
    row (migration 0017). Inlined, the plan shows its CASE and not the function; every missing
    field is still named, in the envelope's order."""
    plan = "\n".join(
        r[0]
        for r in outbox.execute(
            "EXPLAIN (VERBOSE) SELECT chessboard.outbox_event_defect(message_key, payload)"
            " FROM chessboard.outbox_events"
        )
    )
    assert "CASE" in plan and "outbox_event_defect" not in plan, plan
    key = str(uuid.uuid4())
    envelope = ["ContractVersion", "EventId", "CreatedAt", "Id", "Version"]
    for missing in (["EventId"], ["ContractVersion", "Id"], ["CreatedAt", "Version"], envelope):
        event = {k: v for k, v in payload(TOPIC_LAYOUT_GROUP, key, 1).items() if k not in missing}
        found = outbox.execute(
            "SELECT chessboard.outbox_event_defect(%s, %s)", (key, Jsonb(event))
        ).fetchone()
        assert found == ("payload misses " + ", ".join(missing),)
    assert outbox.execute(
        "SELECT chessboard.outbox_event_defect(%s, %s)",
        (key, Jsonb(payload(TOPIC_LAYOUT_GROUP, key, 1))),
    ).fetchone() == (None,)


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


def test_an_event_kafka_refuses_aborts_its_batch_which_goes_out_again_without_it(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    """A batch is all or nothing. Tried: a topic whose broker limit (max.message.bytes 2048) is
    below an event the relay itself finds small enough, between events of another key on the
    usual topic. The broker refuses it for good: the transaction is aborted (so the other events,
    already acknowledged, never reach a read_committed consumer in it), the refused event is
    dead-lettered with Kafka's reason, and the rest goes out again in a new transaction, once.
    (How much of the aborted attempt the broker stored depends on timing: a four-worker run saw
    none of it, where the test had assumed all.)"""
    small = f"pin.test.relay-small.{uuid.uuid4().hex[:8]}"
    client = admin(kafka_bootstrap)  # kept: the result dies with its client
    [created] = client.create_topics(
        [NewTopic(small, num_partitions=1, replication_factor=1,
                  config={"max.message.bytes": "2048"})]
    ).values()  # fmt: skip
    created.result(timeout=15)
    try:
        outbox.execute(
            "INSERT INTO chessboard.outbox_topics (topic, required_fields)"
            " SELECT %s, required_fields FROM chessboard.outbox_topics WHERE topic = %s",
            (small, TOPIC_LAYOUT_GROUP),
        )
        fine, refused = str(uuid.uuid4()), str(uuid.uuid4())
        noise = base64.b64encode(os.urandom(6000)).decode()  # lz4 cannot shrink it below 2048
        rows = [(TOPIC_LAYOUT_GROUP, fine, payload(TOPIC_LAYOUT_GROUP, fine, v)) for v in (1, 2)]
        rows.append((small, refused, payload(TOPIC_LAYOUT_GROUP, refused, 1, Name=noise)))
        rows.append((TOPIC_LAYOUT_GROUP, fine, payload(TOPIC_LAYOUT_GROUP, fine, 3)))
        ids = insert(outbox, rows)
        before = topic_counters(outbox).get(TOPIC_LAYOUT_GROUP, {}).get("published", 0)

        summary = relay_once(Settings.from_env())

        assert (summary.published, summary.dead_lettered) == (3, 1)
        assert summary.batches == 2  # the aborted one, then the one without the refused event
        assert outbox_count(outbox) == 0
        [(letter_id, letter_error)] = outbox.execute(
            "SELECT id, error FROM chessboard.outbox_dead_letters"
        ).fetchall()
        assert letter_id == ids[2]
        assert letter_error.startswith("Kafka refused the event: "), letter_error
        assert topic_counters(outbox)[TOPIC_LAYOUT_GROUP]["published"] - before == 3
        committed = consume(kafka_bootstrap, start, {fine})
        assert [json.loads(v)["Version"] for _, _, v in committed] == [1, 2, 3]
        # What the broker stored of the aborted attempt, before the one it kept: what it had
        # acknowledged when the refusal failed the transaction, the rest purged unsent
        # (producer.Failure.purged). All three on an idle machine, fewer under load: a prefix.
        # Whatever it stored, only read_committed keeps it out.
        everything = consume(kafka_bootstrap, start, {fine}, isolation="read_uncommitted")
        versions = [json.loads(v)["Version"] for _, _, v in everything]
        aborted, kept = versions[:-3], versions[-3:]
        assert (aborted, kept) == ([1, 2, 3][: len(aborted)], [1, 2, 3]), versions
    finally:
        outbox.execute("DELETE FROM chessboard.outbox_topics WHERE topic = %s", (small,))
        delete_topics(kafka_bootstrap, (small,))


def test_a_message_is_stamped_with_its_outbox_row_creation_time(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    """Tried: two events written a second apart and relayed together 1.5 s later. Each
    message's Kafka timestamp is its outbox row's `created_at` to the millisecond (CreateTime),
    not the moment the relay or the broker handled it: freshness downstream counts the wait in
    the outbox too. Without a recalc span the message has no traceparent header."""
    keys = [str(uuid.uuid4()) for _ in range(2)]
    for key in keys:
        insert(outbox, [(TOPIC_LAYOUT_GROUP, key, payload(TOPIC_LAYOUT_GROUP, key, 1))])
        time.sleep(1.0)
    time.sleep(0.5)
    created = dict(
        outbox.execute(
            "SELECT message_key, (extract(epoch FROM created_at) * 1000)::bigint"
            " FROM chessboard.outbox_events"
        ).fetchall()
    )
    assert relay_once(Settings.from_env()).published == 2
    messages = consume_messages(kafka_bootstrap, start, set(keys))
    stamped = {bytes(m.key() or b"").decode(): m.timestamp() for m in messages}
    assert stamped == {key: (TIMESTAMP_CREATE_TIME, created[key]) for key in keys}
    assert [m.headers() for m in messages] == [None, None]


def test_pin_outbox_relay_without_once_relays_continuously_until_sigterm(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    """Tried: `pin outbox relay` without --once, events committed in three rounds a
    second apart while it runs: each round is in Kafka within 2 s of its commit without another
    launch; SIGTERM then ends it with exit 0 and the JSON summary of everything it published, and
    the outbox is empty."""
    relay = subprocess.Popen(
        [str(Path(sys.executable).with_name("pin")), "outbox", "relay"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    warm = str(uuid.uuid4())
    keys: list[str] = [warm]
    try:
        insert(outbox, [(TOPIC_PROJECT, warm, payload(TOPIC_PROJECT, warm, 1))])
        deadline = time.monotonic() + 30  # interpreter and producer start-up
        while outbox_count(outbox) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(3):
            batch = [str(uuid.uuid4()) for _ in range(20)]
            insert(outbox, [(TOPIC_PROJECT, k, payload(TOPIC_PROJECT, k, 1)) for k in batch])
            keys += batch
            committed = time.monotonic()
            while outbox_count(outbox) and time.monotonic() - committed < 2.0:
                time.sleep(0.05)
            assert outbox_count(outbox) == 0, "not relayed within 2 s"
            time.sleep(1.0)
        relay.send_signal(signal.SIGTERM)
        stdout, stderr = relay.communicate(timeout=15)
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate(timeout=10)
    assert relay.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["published"] == len(keys)
    assert sorted(k for _, k, _ in consume(kafka_bootstrap, start, set(keys))) == sorted(keys)


HANDOVER_SCRIPT = """
import sys, time
from pin_pipelines.config import Settings
from pin_pipelines.relay import OutboxRelay
budget = float(sys.argv[1])
with OutboxRelay(Settings.from_env()) as relay:
    deadline = time.monotonic() + budget
    summary = relay.run_until(lambda: time.monotonic() >= deadline)
print(summary.published, flush=True)
"""


def test_a_relay_hands_over_to_its_successor_without_loss_or_reordering(
    outbox: psycopg.Connection, start: dict[str, dict[int, int]], kafka_bootstrap: str
) -> None:
    """Tried: the hand-over of the Dagster relay runs with real processes. A relay
    runs 4 s; its successor starts 2 s in and waits for the relay lock; meanwhile 20 keys get a
    new Version every 50 ms, through the hand-over and after. A read_committed consumer sees
    every event exactly once, each key's Version strictly increasing in offset order, and both
    relays published (the successor took over)."""
    keys = [str(uuid.uuid4()) for _ in range(20)]
    pin_python = str(Path(sys.executable))
    first = subprocess.Popen(
        [pin_python, "-c", HANDOVER_SCRIPT, "4"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    successor: subprocess.Popen[str] | None = None
    version, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < 7.0:
            version += 1
            insert(outbox, [(TOPIC_LAYOUT, k, payload(TOPIC_LAYOUT, k, version)) for k in keys])
            if successor is None and time.monotonic() - started > 2.0:
                successor = subprocess.Popen(
                    [pin_python, "-c", HANDOVER_SCRIPT, "6"],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            time.sleep(0.05)
        published = [int(first.communicate(timeout=30)[0].strip())]
        assert successor is not None
        published.append(int(successor.communicate(timeout=30)[0].strip()))
    finally:
        for proc in (first, successor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert outbox_count(outbox) == 0
    assert all(n > 0 for n in published), published
    seen: dict[str, list[int]] = {}
    for _, key, value in consume(kafka_bootstrap, start, set(keys)):
        seen.setdefault(key, []).append(json.loads(value)["Version"])
    assert seen == {key: list(range(1, version + 1)) for key in keys}
    assert sum(published) == 20 * version
