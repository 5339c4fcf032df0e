"""Network partitions: a peer blackholed with iptables (tests/support/blackhole.py),
every packet dropped both ways, no RST and no FIN, as when a host loses its network. A killed
process or a refused port is an error at once; this is silence, which only the project's own
bounds end (config.DEAD_PEER_SECONDS, both ends of every PostgreSQL connection)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import DEAD_PEER_SECONDS
from pin_pipelines.devstats.dim import TABLE
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.kafka import TOPIC_PROJECT
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.blackhole import Direction, blackhole
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.cli import run_pin, summary
from tests.support.clickhouse import server_url
from tests.support.devstats import Group, produce_events
from tests.support.loaders import loader_env, loaders, versions, wait_for
from tests.support.outbox import TOPICS, backlog, outbox_count
from tests.support.pg import dbname
from tests.support.recalc import PIN, REPO_ROOT, outbox, pin_env, queue_row, slow_recalc
from tests.support.relay import assert_exactly_once_in_order
from tests.support.truth import drift


@pytest.fixture(scope="module")
def kafka_bootstrap(kafka: LocalKafka) -> str:
    """Every Kafka of this module is the worker's private broker: the loader's partition
    blackholes the broker's port, which on the shared broker would cut every other worker's
    tests off with it. The other cuts are of ports no other test uses (a drain's one
    connection, a private ClickHouse server), so the module runs beside the others."""
    return kafka.settings.kafka_bootstrap


#: The drain's recalc of a project sleeps this long (a test trigger): the cut lands inside it.
PROJECT_SECONDS = 3.0


def sleeping_client_port(conn: psycopg.Connection) -> int | None:
    """The client port of the backend inside the slow trigger (its drain's connection)."""
    row = conn.execute(
        "SELECT client_port FROM pg_stat_activity"
        " WHERE wait_event = 'PgSleep' AND datname = current_database()"
    ).fetchone()
    return None if row is None else int(row[0])


def test_a_drain_cut_off_inside_a_project_frees_it_and_ends_in_one_line(
    db: psycopg.Connection, pg_dsn: str
) -> None:
    """Tried: drain A (`pin recalc drain --once`) is inside a project's transaction (a test
    trigger sleeps in its UPDATE) when its one connection is blackholed; PostgreSQL and every
    other client are fine. Without keepalives the server kept A's session and row locks for the
    kernel's retransmission timeout (~15 min): SKIP LOCKED passed over the project, and A waited
    on its dead socket as long. Now the server's keepalives and client check end A's session
    within DEAD_PEER_SECONDS, a healthy drain B (a `pin recalc drain --once` a second) recalcs
    the project within 30 s of the cut, A exits with one line within 60 s, and the project was
    applied once: one version, one outbox event, no drift."""
    project = make_project(db)
    make_object(db, project, make_building(db, project), None, status="Free", price=5)
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    version_before = _project_version(db, project)
    with slow_recalc(db, PROJECT_SECONDS):
        cut_off = subprocess.Popen(
            [PIN, "recalc", "drain", "--once"],
            cwd=REPO_ROOT,
            env=pin_env(pg_dsn),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(
                lambda: sleeping_client_port(db) is not None,
                timeout=30,
                what="drain A inside the project",
            )
            port = sleeping_client_port(db)
            assert port is not None
            with blackhole(port):
                cut_at = time.monotonic()
                recalculated_after = _drain_until_gone(pg_dsn, db, project, cut_at, timeout=30)
                out, err = cut_off.communicate(timeout=max(1.0, cut_at + 60 - time.monotonic()))
                ended_after = time.monotonic() - cut_at
        finally:
            if cut_off.poll() is None:
                cut_off.kill()
                cut_off.communicate()
    assert recalculated_after <= 30, recalculated_after
    assert cut_off.returncode == 1, (out, err)
    assert ended_after <= 60, ended_after
    # Its log lines are JSON; its end is the one line a person reads.
    errors = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(errors) == 1, err
    assert errors[0].startswith("pin: error: PostgreSQL at ") and "connection lost" in errors[0]
    print(f"recalculated by B {recalculated_after:.1f}s, A ended {ended_after:.1f}s after the cut")
    assert _project_version(db, project) == version_before + 1
    assert [topic for topic, _, _ in outbox(db, project)] == [TOPIC_PROJECT]
    assert drift(db) == {}


def _drain_until_gone(
    dsn: str, db: psycopg.Connection, project: UUID, since: float, timeout: float
) -> float:
    """Runs a healthy `pin recalc drain --once` a second until the project's row is gone;
    returns the seconds from `since`."""
    while time.monotonic() - since < timeout:
        subprocess.run(
            [PIN, "recalc", "drain", "--once"],
            cwd=REPO_ROOT,
            env=pin_env(dsn),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if queue_row(db, project) is None:
            return time.monotonic() - since
        time.sleep(1.0)
    raise AssertionError(
        f"no healthy drain recalculated the project within {timeout:g}s of the cut "
        f"(dead-peer bound {DEAD_PEER_SECONDS}s): {queue_row(db, project)}"
    )


def _project_version(db: psycopg.Connection, project: UUID) -> int:
    row = db.execute("SELECT version FROM chessboard.projects WHERE id = %s", (project,)).fetchone()
    assert row is not None
    return int(row[0])


# --- the continuous loader through a Kafka partition -------------------------------------------

#: How long the broker is cut off: past the loader's session (10 s) and its join bound (30 s).
KAFKA_PARTITION_SECONDS = 30.0


@pytest.mark.parametrize(
    "join_timeout", [None, 5.0], ids=["defaults", "rejoined-by-a-new-consumer"]
)
def test_a_continuous_loader_rides_out_a_kafka_partition_with_no_operator(
    join_timeout: float | None,
    chdb_folder_url: str,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a continuous `pin devstats load` (the embedded engine, its folder's owner) has
    joined its group and loaded a first event when the broker's port is blackholed for 30 s:
    its session expires, the group loses it, its commits and fetches hang. Without the rejoin it
    stayed alive but never got partitions again: 90 s after the heal none of the new versions was
    loaded. Now every version produced after the heal is visible within 30 s of it, with no
    operator, and the loader then stops cleanly on SIGTERM with its summary. With the defaults
    librdkafka's own rejoin gets it back (its requests fail over within DEAD_PEER_SECONDS);
    with a join bound shorter than the partition, the loader gives its consumer up, and a new
    one (several, while the broker stays silent) joins once it answers."""
    port = int(kafka_bootstrap.rsplit(":", 1)[1])
    env = loader_env(chdb_folder_url, kafka_bootstrap, pg_dsn, tmp_path)
    if join_timeout is not None:
        env["PIN_TEST_JOIN_TIMEOUT"] = str(join_timeout)
    developer = uuid.uuid4()
    with loaders(loader_options, env, tmp_path) as start:
        loader = start("loader")
        first = Group(developer_id=developer)
        produce_events(kafka_bootstrap, loader_options.topic, [first.event(1)])
        wait_for("the first event loaded", lambda: versions(chdb_folder_url, [first]) != {}, 60)
        with blackhole(port):
            time.sleep(KAFKA_PARTITION_SECONDS)
        healed = time.monotonic()
        later = [Group(developer_id=developer) for _ in range(200)]
        produce_events(
            kafka_bootstrap,
            loader_options.topic,
            [g.event(v) for v in range(1, 11) for g in later] + [first.event(2)],
        )
        everyone = [first, *later]
        expected = {g.id: 10 for g in later} | {first.id: 2}
        wait_for(
            "every version produced after the heal loaded",
            lambda: versions(chdb_folder_url, everyone) == expected,
            timeout=healed + 30 - time.monotonic(),
        )
        visible_after = time.monotonic() - healed
        summary_, _took = loader.stop()
    print(f"after the heal: everything visible {visible_after:.1f}s later; summary {summary_}")
    assert summary_["dead_lettered"] == 0
    rejoined = loader.err.read_text().count("joining it again with a new consumer")
    assert (rejoined > 0) == (join_timeout is not None), loader.err.read_text()[-2000:]


# --- the continuous loader cut off from its ClickHouse server -----------------------------------

#: How long the server is cut off: past the loader's attempts of a batch (5, waiting 0.5–4 s).
CLICKHOUSE_PARTITION_SECONDS = 30.0
#: The cut-off loader ends within this: keepalive finds the silence (11 s), then its attempts.
CLICKHOUSE_GIVE_UP_SECONDS = 45.0


@pytest.mark.parametrize("direction", ["both", "from_port"], ids=["partition", "answers-lost"])
def test_a_loader_cut_off_from_its_clickhouse_server_ends_in_one_line_and_the_next_loads_once(
    direction: Direction,
    private_clickhouse_server: LocalClickHouseServer,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a continuous `pin devstats load` on a ClickHouse server (this test's own) has
    loaded a first event when the server's port goes silent for 30 s, both ways (a partition)
    or only the server's answers (`answers-lost`: the loader's insert arrives and is stored, it
    never hears so). Events keep arriving in Kafka meanwhile. Without keepalives every attempt of
    the batch waited out the driver's 60 s receive timeout: minutes before the loader said
    anything. Now keepalive finds the silence within DEAD_PEER_SECONDS, the batch's attempts run
    out, and the loader ends within 45 s of the cut with one line, its offsets not committed
    past what it stored. The next loader (what the sensor launches; here a second process
    after the heal) has every version visible within 30 s of the heal, and none is stored twice
    (the guard reads what the lost answers had stored)."""
    url = server_url(private_clickhouse_server)
    summary(run_pin("db", "migrate", env={"PIN_CLICKHOUSE_URL": url}))
    env = loader_env(url, kafka_bootstrap, pg_dsn, tmp_path)
    developer = uuid.uuid4()
    everyone = [Group(developer_id=developer) for _ in range(100)]
    with loaders(loader_options, env, tmp_path) as start:
        cut_off = start("cut-off")
        produce_events(kafka_bootstrap, loader_options.topic, [everyone[0].event(1)])
        wait_for("the first event loaded", lambda: versions(url, everyone[:1]) != {}, 60)
        with blackhole(private_clickhouse_server.address.port, direction):
            cut_at = time.monotonic()
            for version in range(1, 6):
                produce_events(
                    kafka_bootstrap, loader_options.topic, [g.event(version) for g in everyone]
                )
                time.sleep(CLICKHOUSE_PARTITION_SECONDS / 5)
            code = cut_off.process.wait(
                max(1.0, cut_at + CLICKHOUSE_GIVE_UP_SECONDS - time.monotonic())
            )
            ended_after = time.monotonic() - cut_at
        healed = time.monotonic()
        start("next")
        wait_for(
            "every version loaded after the heal",
            lambda: versions(url, everyone) == {g.id: 5 for g in everyone},
            timeout=30,
        )
        visible_after = time.monotonic() - healed
    errors = [line for line in cut_off.err.read_text().splitlines() if line.startswith("pin:")]
    assert code == 1 and len(errors) == 1, cut_off.err.read_text()[-2000:]
    assert f"ClickHouse server at 127.0.0.1:{private_clickhouse_server.address.port}" in errors[0]
    assert "offsets are not committed" in errors[0]
    with open_clickhouse(url) as ch:
        stored_twice = ch.rows(
            f"SELECT LayoutGroupId, SourceVersion FROM {TABLE} WHERE DeveloperId = %(developer)s"
            " GROUP BY LayoutGroupId, SourceVersion HAVING count() > 1",
            {"developer": developer},
        )
    print(
        f"{direction}: the cut-off loader ended {ended_after:.1f}s after the cut; everything "
        f"visible {visible_after:.1f}s after the heal"
    )
    assert stored_twice == []


# --- the continuous relay through a Kafka partition -------------------------------------------

#: As in the trial that found the relay riding it out: it must stay that way.
RELAY_PARTITION_SECONDS = 25.0


def test_a_continuous_relay_rides_out_a_kafka_partition_while_edits_keep_coming(
    outbox: psycopg.Connection,
    pg_dsn: str,
    kafka: LocalKafka,
    tmp_path: Path,
) -> None:
    """Tried: a continuous `pin outbox relay` (a real process, this module's own broker and
    transactional.id) publishes while a writer commits 10 outbox events every 0.2 s, and the
    broker's port is blackholed for 25 s mid-way; its open transaction's deliveries hang and
    time out, its producer is re-made. After the heal it catches up within 30 s, and a
    read_committed consumer sees every event exactly once with each key's Version increasing."""
    bootstrap = kafka.settings.kafka_bootstrap
    port = int(bootstrap.rsplit(":", 1)[1])
    start = end_offsets(bootstrap, TOPICS)
    env = {
        **pin_env(pg_dsn),
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-{dbname(pg_dsn)}-partition",
    }
    events: dict[str, list[str]] = {}
    writing = threading.Event()
    writing.set()

    def write() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            while writing.is_set():
                events.update(backlog(conn, keys=10, versions=1))
                time.sleep(0.2)

    err = tmp_path / "relay.err"
    with err.open("w") as stderr:
        relay = subprocess.Popen(
            [PIN, "outbox", "relay"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    writer = threading.Thread(target=write, name="outbox-writer")
    writer.start()
    try:
        time.sleep(5)
        with blackhole(port):
            time.sleep(RELAY_PARTITION_SECONDS)
        healed = time.monotonic()
        time.sleep(5)
        writing.clear()
        writer.join()
        wait_for(
            "the outbox empty", lambda: outbox_count(outbox) == 0, healed + 30 - time.monotonic()
        )
        caught_up = time.monotonic() - healed
        relay.send_signal(signal.SIGTERM)
        relay.communicate(timeout=30)
    finally:
        writing.clear()
        writer.join()
        if relay.poll() is None:
            relay.kill()
            relay.communicate()
    assert relay.returncode == 0, err.read_text()[-2000:]
    print(f"relay: the outbox empty {caught_up:.1f}s after the heal (writes went on for 5 s)")
    assert_exactly_once_in_order(bootstrap, start, events)
