"""Exactly once into Kafka across crashes, on a private broker of this module.

The failure it prevents: the broker killed mid-relay and kept down past the relay's timeout; the
next relay sent again what the broker had stored without acknowledging it, after newer events, so
per key the Version went 2,3,4,5,4,5. Now every batch is a Kafka transaction with a receipt. Each
test kills something at a chosen point (the broker, or the relay in one of its two windows), lets a
relay run again, and reads every topic with read_committed, as the contract's consumers do: each
outbox event exactly once (by EventId) and per key the Version strictly increasing.

The broker is killed for real (SIGKILL), so it is the session's private one
(tests/support/private_kafka.py), never the shared one on 9092.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.relay import OutboxRelay, relay_once, topic_counters
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.relay.outbox import DELIVERY_TIMEOUT
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.cli import PIN, assert_one_line_error
from tests.support.outbox import TOPICS, backlog, outbox_count
from tests.support.pg import dbname
from tests.support.private_kafka import kill_broker, restart_broker, stop_broker
from tests.support.recalc import REPO_ROOT as ROOT
from tests.support.relay import Offsets, assert_exactly_once_in_order, consume


@pytest.fixture
def transactional_id(pg_dsn: str) -> str:
    """The relays of this module: their own id, on their own broker."""
    return f"pin-outbox-relay-{dbname(pg_dsn)}-private"


@pytest.fixture
def settings(kafka: LocalKafka, pg_dsn: str, transactional_id: str) -> Settings:
    return Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_KAFKA_BOOTSTRAP": kafka.settings.kafka_bootstrap,
            "PIN_RELAY_TRANSACTIONAL_ID": transactional_id,
        }
    )


@pytest.fixture
def relay_env(settings: Settings) -> dict[str, str]:
    """The environment of a relay process: this module's broker and transactional.id."""
    return {
        **os.environ,
        "PIN_PG_DSN": settings.pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "PIN_RELAY_TRANSACTIONAL_ID": settings.relay_transactional_id,
    }


@pytest.fixture
def start(outbox: psycopg.Connection, settings: Settings) -> Offsets:
    """End offsets on the private broker before the test: what the test reads from."""
    return end_offsets(settings.kafka_bootstrap, TOPICS)


def published_counter(conn: psycopg.Connection) -> int:
    return sum(topic_counters(conn).get(t, {}).get("published", 0) for t in TOPICS)


def last_seq(conn: psycopg.Connection, transactional_id: str) -> int:
    row = conn.execute(
        "SELECT last_seq FROM chessboard.outbox_relay_commits WHERE transactional_id = %s",
        (transactional_id,),
    ).fetchone()
    return int(row[0]) if row else 0


def relay_waits_for_a_lock(conn: psycopg.Connection) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'pin-outbox-relay' AND wait_event_type = 'Lock'"
        ).fetchone()
        is not None
    )


def stop(process: subprocess.Popen[str]) -> None:
    """Kill and reap (nothing a test starts outlives it)."""
    process.kill()
    process.wait(timeout=30)


# --- the broker dies ------------------------------------------------------------------------


def test_broker_killed_mid_transaction_and_kept_down_past_the_timeout_loses_and_repeats_nothing(
    outbox: psycopg.Connection,
    start: Offsets,
    kafka: LocalKafka,
    settings: Settings,
    relay_env: dict[str, str],
    pg_dsn: str,
) -> None:
    """Tried: `pin outbox relay --once` publishing 3,000 events (300 keys, versions 1..10), the
    broker SIGKILLed once all of them are on it but the transaction is not committed, kept down
    until the relay gave up (past its delivery timeout), restarted, the relay run again.

    To hit that window every time, the test holds the relay's bookkeeping row locked: the relay
    stops on it with its events sent and its rows deleted in its open PostgreSQL transaction,
    the last statement before the Kafka commit."""
    warm = backlog(outbox, keys=3, versions=1)  # a committed transaction and receipt before
    relay_once(settings)
    events = backlog(outbox, keys=300, versions=10)
    before = end_offsets(settings.kafka_bootstrap, TOPICS)
    counted = published_counter(outbox)
    seq = last_seq(outbox, settings.relay_transactional_id)

    try:
        with psycopg.connect(pg_dsn) as holder:
            holder.execute(
                "SELECT 1 FROM chessboard.outbox_relay_commits WHERE transactional_id = %s"
                " FOR UPDATE",
                (settings.relay_transactional_id,),
            )
            relay = subprocess.Popen(
                [PIN, "outbox", "relay", "--once"],
                env=relay_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                wait_until(
                    lambda: relay_waits_for_a_lock(outbox),  # autocommit: fresh activity
                    timeout=60,
                    what="the relay stopping before its Kafka commit",
                )
                stored = end_offsets(settings.kafka_bootstrap, TOPICS)
                written = sum(stored[t][p] - before[t][p] for t in TOPICS for p in stored[t])
                assert written >= 3000  # every event is on the broker, in an open transaction
                kill_broker(kafka)
                killed = time.monotonic()
                holder.rollback()  # the relay goes on to its commit, with no broker
                out, err = relay.communicate(timeout=DELIVERY_TIMEOUT + 60)
                down_for = time.monotonic() - killed
            finally:
                stop(relay)
        assert_one_line_error(
            subprocess.CompletedProcess(relay.args, relay.returncode, out, err),
            f"Kafka at {settings.kafka_bootstrap} did not acknowledge",
        )
        assert down_for > DELIVERY_TIMEOUT
        assert outbox_count(outbox) == 3000  # rolled back: nothing deleted, nothing counted
        assert published_counter(outbox) == counted
        assert last_seq(outbox, settings.relay_transactional_id) == seq
    finally:
        restart_broker(kafka)  # a no-op when the test failed before the kill

    again = subprocess.run(
        [PIN, "outbox", "relay", "--once"],
        env=relay_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert (summary["published"], summary["recovered"], summary["pending"]) == (3000, 0, 0)
    assert outbox_count(outbox) == 0
    assert published_counter(outbox) == counted + 3000
    assert_exactly_once_in_order(settings.kafka_bootstrap, start, warm | events)
    # The killed transaction's copies are in the log: aborted, so only read_committed skips them.
    uncommitted = consume(settings.kafka_bootstrap, start, set(events), "read_uncommitted")
    assert len(uncommitted) == 6000


def test_broker_down_keeps_events_and_publishes_them_when_back(
    outbox: psycopg.Connection, start: Offsets, kafka: LocalKafka, settings: Settings
) -> None:
    """Tried: the broker stopped under a relay whose producer is connected (its deliveries time
    out), then a fresh relay against the stopped broker (unreachable), then the first relay again
    once the broker is back: one-line errors, the events stay, then go out once."""
    warm = backlog(outbox, keys=1, versions=1)
    with OutboxRelay(settings, delivery_timeout=5) as relay:
        assert relay.run_once().published == 1  # its producer is connected when the broker dies
        events = backlog(outbox, keys=20, versions=1)
        stop_broker(kafka)
        try:
            with pytest.raises(PinError) as mid_run:
                relay.run_once()
            assert outbox_count(outbox) == 20
            with pytest.raises(PinError) as fresh:
                relay_once(settings)
            assert outbox_count(outbox) == 20
        finally:
            restart_broker(kafka)
        # The fresh relay stops at its start check, which names the worker (worker.check_services).
        assert str(mid_run.value).startswith(f"Kafka at {settings.kafka_bootstrap} ")
        assert str(fresh.value).startswith(
            f"the outbox relay cannot start: Kafka at {settings.kafka_bootstrap} "
        )
        for error in (mid_run.value, fresh.value):
            assert "\n" not in str(error)
        assert "timed out" in str(mid_run.value) and "unreachable" in str(fresh.value)

        assert relay.run_once().published == 20  # the same relay, after the outage
    assert outbox_count(outbox) == 0
    assert_exactly_once_in_order(settings.kafka_bootstrap, start, warm | events)


# --- the relay dies -------------------------------------------------------------------------

#: A relay process that stops at a hook (`on_flushed` or `on_committed`) of its n-th batch,
#: says so, and waits for a file before it goes on (a test kills it there, or lets it go on).
HOOKED_RELAY = """
import sys, time
from pathlib import Path
from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.relay import relay_once

hook, at, batch_size, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
calls = 0

def pause():
    global calls
    calls += 1
    if calls == at:
        print(hook, flush=True)
        while not go.exists():
            time.sleep(0.01)

try:
    relay_once(Settings.from_env(), batch_size=batch_size, **{hook: pause})
except PinError as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
"""


@contextlib.contextmanager
def relay_paused_at(
    hook: str, batch: int, batch_size: int, env: dict[str, str], go: Path
) -> Iterator[subprocess.Popen[str]]:
    """A relay process stopped at `hook` of its `batch`-th batch; killed and reaped at the end."""
    relay = subprocess.Popen(
        [sys.executable, "-c", HOOKED_RELAY, hook, str(batch), str(batch_size), str(go)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == hook
        yield relay
    finally:
        stop(relay)


def test_relay_killed_mid_transaction_is_undone_and_sent_again_once(
    outbox: psycopg.Connection,
    start: Offsets,
    settings: Settings,
    relay_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Tried: SIGKILL of a relay in its second batch, once its events are acknowledged and its
    rows deleted in the open PostgreSQL transaction, before the Kafka commit; then a new relay.
    The first batch stays published; the second is aborted by the new relay's producer and sent
    again by it."""
    events = backlog(outbox, keys=60, versions=10)
    counted = published_counter(outbox)
    with relay_paused_at("on_flushed", 2, 200, relay_env, tmp_path / "go") as relay:
        os.kill(relay.pid, signal.SIGKILL)
        relay.wait(timeout=10)
    assert outbox_count(outbox) == 400  # the first batch deleted, the second rolled back

    summary = relay_once(settings)

    assert (summary.published, summary.recovered) == (400, 0)
    assert outbox_count(outbox) == 0
    assert published_counter(outbox) == counted + 600
    assert_exactly_once_in_order(settings.kafka_bootstrap, start, events)
    uncommitted = consume(settings.kafka_bootstrap, start, set(events), "read_uncommitted")
    assert len(uncommitted) == 800  # the killed batch's 200 are there, aborted


def test_relay_killed_after_the_kafka_commit_is_completed_from_its_receipt(
    outbox: psycopg.Connection,
    start: Offsets,
    settings: Settings,
    relay_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Tried: SIGKILL of a relay in its second batch after the Kafka commit, before the
    PostgreSQL one: the batch is published but its rows are back in the outbox. The next relay
    finds the batch's receipt, deletes exactly those rows and counts them, and sends only the
    rest: no duplicate, each event counted once."""
    events = backlog(outbox, keys=60, versions=10)
    counted = published_counter(outbox)
    seq = last_seq(outbox, settings.relay_transactional_id)
    with relay_paused_at("on_committed", 2, 200, relay_env, tmp_path / "go") as relay:
        os.kill(relay.pid, signal.SIGKILL)
        relay.wait(timeout=10)
    assert outbox_count(outbox) == 400  # the second batch is in Kafka and still here
    assert last_seq(outbox, settings.relay_transactional_id) == seq + 1
    assert len(consume(settings.kafka_bootstrap, start, set(events))) == 400

    summary = relay_once(settings)

    assert (summary.recovered, summary.published) == (200, 200)
    assert outbox_count(outbox) == 0
    assert published_counter(outbox) == counted + 600
    assert last_seq(outbox, settings.relay_transactional_id) == seq + 3
    assert_exactly_once_in_order(settings.kafka_bootstrap, start, events)


def test_a_relay_that_lost_its_session_is_fenced_by_the_next_one(
    outbox: psycopg.Connection,
    start: Offsets,
    settings: Settings,
    relay_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Tried: a relay stalled before its Kafka commit loses its PostgreSQL session (and with it
    the relay lock), a second relay with the same transactional.id takes over and publishes
    everything, then the first one wakes up and commits. Its producer was fenced: the commit
    fails with a one-line error, and its copies never become visible."""
    events = backlog(outbox, keys=30, versions=4)
    go = tmp_path / "go"
    with relay_paused_at("on_flushed", 1, 200, relay_env, go) as stale:
        (ended,) = outbox.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'pin-outbox-relay'"
        ).fetchone() or (0,)
        assert ended == 1

        assert relay_once(settings).published == 120

        go.touch()
        _, err = stale.communicate(timeout=60)
        assert stale.returncode == 1
        # Its last word; psycopg may warn before it that the rollback found the session gone.
        assert (
            err.strip()
            .splitlines()[-1]
            .startswith(
                f"another relay with transactional.id {settings.relay_transactional_id} took over"
            )
        ), err
        assert "FATAL" not in err  # librdkafka's own line about it goes to the debug log
    assert outbox_count(outbox) == 0
    assert_exactly_once_in_order(settings.kafka_bootstrap, start, events)
