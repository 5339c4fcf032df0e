"""The relay woken at the commit: the outbox trigger's one notification per transaction, a
continuous `pin outbox relay` woken by it rather than by its backstop, and a notification lost
(no notification at all, then the listening session ended on the server) covered by the
backstop, the relay listening again afterwards. Real relay processes on the shared PostgreSQL
and Kafka."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.types.json import Jsonb

from pin_pipelines.db import connect
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_PROJECT
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.relay.listener import OutboxListener
from tests.support.cli import PIN, finish, load_summary
from tests.support.outbox import TOPICS, insert, outbox_count, payload
from tests.support.relay import consume

#: Bounds of the waits for a relay process (its interpreter and producer start on a loaded
#: machine), all below the one-minute backstop of the first test.
START_SECONDS = 40.0
RELAYED_SECONDS = 40.0
#: What on-call sees (docs/runbook.md): the channel the outbox trigger notifies, and the relay's
#: listening session in pg_stat_activity.
CHANNEL = "chessboard_outbox_events"
LISTENER = "pin-outbox-listener"
#: A descriptor number that select() refuses (FD_SETSIZE): a long-lived process holding many
#: (a run worker beside its clients, a test worker) gives the listener's socket one above it.
FD_SETSIZE = 1024


@contextmanager
def continuous_relay(backstop_seconds: float) -> Iterator[subprocess.Popen[str]]:
    """`pin outbox relay` with this backstop; killed if the test did not end it."""
    relay = subprocess.Popen(
        [PIN, "outbox", "relay"],
        env={**os.environ, "PIN_RELAY_BACKSTOP_SECONDS": str(backstop_seconds)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield relay
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate(timeout=10)


def stopped(relay: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    relay.send_signal(signal.SIGTERM)
    return finish(relay, timeout=30)


def wait_relayed(outbox: psycopg.Connection, what: str) -> None:
    deadline = time.monotonic() + RELAYED_SECONDS
    while outbox_count(outbox) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outbox_count(outbox) == 0, f"{what} not relayed within {RELAYED_SECONDS:g}s"


def listening_pid(conn: psycopg.Connection, other_than: int = 0) -> int:
    """The relay's listening backend once it listens (its last statement is the LISTEN)."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND query LIKE 'LISTEN %%' AND pid <> %s",
            (LISTENER, other_than),
        ).fetchone()
        if row is not None:
            return int(row[0])
        time.sleep(0.1)
    raise AssertionError(f"no relay session listening within {START_SECONDS:g}s")


def test_the_outbox_trigger_notifies_once_per_transaction(
    outbox: psycopg.Connection, pg_dsn: str
) -> None:
    """Tried: one transaction writing five events in three statements (a multi-row INSERT and
    two single-row ones), then one writing one event, then one touching no outbox row: a
    listener gets exactly two notifications, one per transaction that wrote the outbox."""
    keys = [str(uuid.uuid4()) for _ in range(6)]
    rows = [(TOPIC_PROJECT, k, payload(TOPIC_PROJECT, k, 1)) for k in keys]
    with connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with psycopg.connect(pg_dsn) as writer:
            writer.execute(
                "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
                " VALUES (%s, %s, %s), (%s, %s, %s), (%s, %s, %s)",
                [v for t, k, p in rows[:3] for v in (t, k, Jsonb(p))],
            )
            insert(writer, rows[3:5])  # a statement per row
        with psycopg.connect(pg_dsn) as writer:
            insert(writer, rows[5:])
        with psycopg.connect(pg_dsn) as writer:
            writer.execute("UPDATE chessboard.outbox_events SET traceparent = NULL")
        # Every notification of these commits is queued by now; two seconds show no more come.
        notified = [(n.channel, n.payload) for n in listener.notifies(timeout=2)]
    assert notified == [(CHANNEL, "")] * 2
    assert outbox_count(outbox) == 6


def test_a_commit_wakes_the_waiting_relay_which_polls_only_at_its_backstop(
    outbox: psycopg.Connection, kafka_bootstrap: str
) -> None:
    """Tried: a continuous relay with a one-minute backstop, so only a notification can wake
    it sooner; an event relayed to warm it up, then twenty events committed in one transaction
    while it waits. They are in Kafka well within the minute, and the relay looked at the
    outbox five times in all: at its start, and for each of the two commits one run that
    published and one that found the outbox empty; never in between (a 0.1 s poll looks ten
    times a second)."""
    start = end_offsets(kafka_bootstrap, TOPICS)
    warm = str(uuid.uuid4())
    batch = [str(uuid.uuid4()) for _ in range(20)]
    with continuous_relay(backstop_seconds=60) as relay:
        insert(outbox, [(TOPIC_LAYOUT, warm, payload(TOPIC_LAYOUT, warm, 1))])
        wait_relayed(outbox, "the warm-up event")
        time.sleep(1.0)  # the relay waits
        insert(outbox, [(TOPIC_LAYOUT, k, payload(TOPIC_LAYOUT, k, 1)) for k in batch])
        wait_relayed(outbox, "an event committed while the relay waited")
        done = stopped(relay)
    summary = load_summary(done)
    assert summary["published"] == 21
    assert summary["runs"] <= 6, f"the relay looked at the outbox unwoken: {summary['runs']} runs"
    assert sorted(k for _, k, _ in consume(kafka_bootstrap, start, {warm, *batch})) == sorted(
        [warm, *batch]
    )


def test_a_lost_notification_is_caught_by_the_backstop_and_the_relay_listens_again(
    outbox: psycopg.Connection, pg_dsn: str, kafka_bootstrap: str
) -> None:
    """Tried: a relay with a one-second backstop. An event committed with the trigger off
    (`session_replication_role = replica`: its notification never comes) is relayed by the
    backstop. The listening session is then ended on the server (`pg_terminate_backend`): the
    relay says so in one log line, listens again on a new session, and relays the next event.
    Each event reaches Kafka once."""
    start = end_offsets(kafka_bootstrap, TOPICS)
    silent, after = str(uuid.uuid4()), str(uuid.uuid4())
    with continuous_relay(backstop_seconds=1) as relay:
        first = listening_pid(outbox)
        with psycopg.connect(pg_dsn) as writer:
            writer.execute("SET session_replication_role = replica")
            insert(writer, [(TOPIC_LAYOUT, silent, payload(TOPIC_LAYOUT, silent, 1))])
        wait_relayed(outbox, "an event whose notification never came")
        outbox.execute("SELECT pg_terminate_backend(%s)", (first,))
        listening_pid(outbox, other_than=first)
        insert(outbox, [(TOPIC_LAYOUT, after, payload(TOPIC_LAYOUT, after, 1))])
        wait_relayed(outbox, "an event committed after the listening session was lost")
        done = stopped(relay)
    assert load_summary(done)["published"] == 2
    lost = [line for line in done.stderr.splitlines() if "relay_listener_lost" in line]
    assert len(lost) == 1, done.stderr[-2000:]
    assert json.loads(lost[0])["error"], lost[0]  # libpq's words for the closed connection
    assert sorted(k for _, k, _ in consume(kafka_bootstrap, start, {silent, after})) == sorted(
        [silent, after]
    )


@contextmanager
def descriptors_taken_below(number: int) -> Iterator[None]:
    """Every free descriptor below `number` taken (the soft limit raised to allow it), so the
    next one opened is numbered `number` or more; given back at the end."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, number + 64), hard))
    taken: list[int] = []
    try:
        with open(os.devnull) as null:  # open until the end: its descriptor is one of them
            while (fd := os.dup(null.fileno())) < number:
                taken.append(fd)
            os.close(fd)
            yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_listener_whose_socket_is_numbered_above_select_s_limit_is_woken(
    outbox: psycopg.Connection, pg_dsn: str
) -> None:
    """Tried: the relay's listener opened in a process whose descriptors below 1,024 are all
    taken, then an event committed. Before, its wait failed "filedescriptor out of range in
    select()" (a CI run's relay job, run in a test worker that held many, failed so); now the
    commit wakes it."""
    with descriptors_taken_below(FD_SETSIZE), OutboxListener(pg_dsn) as listener:
        assert listener.listen()
        assert listener._conn is not None and listener._conn.fileno() >= FD_SETSIZE
        assert not listener.wait(0.2)  # nothing committed: the wait times out
        key = str(uuid.uuid4())
        insert(outbox, [(TOPIC_LAYOUT, key, payload(TOPIC_LAYOUT, key, 1))])
        assert listener.wait(RELAYED_SECONDS)
