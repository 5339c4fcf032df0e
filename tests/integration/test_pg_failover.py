"""PostgreSQL fails over to its standby under load (CONTRACT §9), on a private primary and its
streaming standby (tests/support/pg_standby.py), with PIN_PG_DSN naming both hosts and
`target_session_attrs=read-write`.

The pipeline runs as in production, each leg in a thread of its own, all through the multi-host
DSN: a writer committing catalogue edits, the drain ticking, one long-lived relay (its session
and transactional producer reused across runs, as `pin outbox relay` and the Dagster relay run
keep them) and the loader into the session's embedded dimension. The snapshot topics are this
module's own (a test-only trigger on the outbox renames them and journals every event written,
so the history survives the relay's deletes): the history checker reads their whole history.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.config import SOURCE_ROOT, Settings, dagster_pg_url_from
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.kafka import (
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    TOPIC_PROJECT,
    delete_topics,
    ensure_topics,
)
from pin_pipelines.migrate import migrate_postgres
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.reconcile import Repair, reconcile
from pin_pipelines.relay import OutboxRelay, events_beyond_source, relay_once, topic_end_offsets
from pin_pipelines.stack.process import wait_until
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.cli import run_pin, summary
from tests.support.history import Written, check, dimension_versions, read_committed
from tests.support.pg_standby import StreamingPair, streaming_pair
from tests.support.recalc import drain_until_empty, set_settings
from tests.support.truth import drift

#: CONTRACT §9: every leg reaches the new primary within this many seconds, no operator.
RESUME_SECONDS = 30.0
PROJECTS = 4


@pytest.fixture(scope="module")
def pair() -> Iterator[StreamingPair]:
    with streaming_pair() as started:
        yield started


@dataclass
class Topics:
    """This module's snapshot topics, by the standard name the drain writes."""

    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @property
    def private(self) -> dict[str, str]:
        return {
            standard: f"pin.test.{standard.split('.')[2]}.{self.suffix}"
            for standard in (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP)
        }


@pytest.fixture
def topics(kafka_bootstrap: str) -> Iterator[Topics]:
    made = Topics()
    ensure_topics(kafka_bootstrap, tuple(made.private.values()))
    yield made
    delete_topics(kafka_bootstrap, tuple(made.private.values()))


def private_outbox(conn: psycopg.Connection, topics: Topics) -> None:
    """Test-only: the drain's events go to this module's topics, and each is journaled as
    written (the relay deletes the outbox rows it published)."""
    renames = " ".join(f"WHEN '{std}' THEN '{own}'" for std, own in topics.private.items())
    with conn.transaction():
        conn.execute(
            "INSERT INTO chessboard.outbox_topics (topic, required_fields)"
            " SELECT own, required_fields FROM chessboard.outbox_topics"
            " JOIN unnest(%s::text[], %s::text[]) AS t(std, own) ON topic = std",
            (list(topics.private), list(topics.private.values())),
        )
        conn.execute(
            "CREATE TABLE chessboard.test_outbox_journal"
            " (id bigint, topic text, message_key text, version int, event_id text)"
        )
        conn.execute(
            "CREATE FUNCTION chessboard.test_private_outbox() RETURNS trigger"
            " LANGUAGE plpgsql AS $$ BEGIN"
            f" NEW.topic := CASE NEW.topic {renames} ELSE NEW.topic END;"
            " INSERT INTO chessboard.test_outbox_journal VALUES (NEW.id, NEW.topic,"
            " NEW.message_key, (NEW.payload->>'Version')::int, NEW.payload->>'EventId');"
            " RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER test_private_outbox BEFORE INSERT ON chessboard.outbox_events"
            " FOR EACH ROW EXECUTE FUNCTION chessboard.test_private_outbox()"
        )


def journal(conn: psycopg.Connection, topic: str) -> list[Written]:
    rows = conn.execute(
        "SELECT message_key, version, event_id, id FROM chessboard.test_outbox_journal"
        " WHERE topic = %s ORDER BY id",
        (topic,),
    ).fetchall()
    return [
        Written(key, version, event_id, outbox_id) for key, version, event_id, outbox_id in rows
    ]


def seed(conn: psycopg.Connection) -> None:
    """A few projects with buildings, two layout groups each, layouts and objects."""
    for _ in range(PROJECTS):
        project = make_project(conn)
        building = make_building(conn, project)
        for _ in range(2):
            group = make_layout_group(conn, project)
            for area in (30, 45):
                layout = make_layout(conn, project, group, area)
                for price in (1000, 2000):
                    make_object(conn, project, building, layout, price=price)


@dataclass
class Leg:
    """One part of the pipeline run in a loop: when each of its steps succeeded, and the
    one-line errors it met (a PinError is an outage to ride out; anything else fails)."""

    name: str
    step: Callable[[], object]
    done: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    crashed: BaseException | None = None

    def run(self, stop: threading.Event, pause: float) -> None:
        try:
            while not stop.is_set():
                try:
                    self.step()
                except PinError as exc:
                    self.errors.append(str(exc))
                else:
                    self.done.append(time.monotonic())
                stop.wait(pause)
        except BaseException as exc:
            self.crashed = exc

    def succeeded_after(self, moment: float) -> float | None:
        later = [t for t in self.done if t > moment]
        return later[0] - moment if later else None


class Writer:
    """Catalogue edits, one committed transaction each, through the multi-host DSN (a new
    session after a lost one, as an application's pool does)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection | None = None
        self.random = random.Random(7)

    def __call__(self) -> None:
        try:
            if self.conn is None or self.conn.broken:
                self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
            if self.random.random() < 0.5:
                self.conn.execute(
                    "UPDATE chessboard.property_objects SET price = %s"
                    " WHERE id = (SELECT id FROM chessboard.property_objects"
                    " ORDER BY random() LIMIT 1)",
                    (Decimal(self.random.randrange(500, 5000)),),
                )
            else:
                self.conn.execute(
                    "UPDATE chessboard.layouts SET total_area = %s"
                    " WHERE id = (SELECT id FROM chessboard.layouts ORDER BY random() LIMIT 1)",
                    (Decimal(self.random.randrange(20, 120)),),
                )
        except psycopg.OperationalError as exc:
            raise PinError(f"writer: {exc}") from exc

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


@pytest.fixture
def instance(
    pair: StreamingPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dg.DagsterInstance]:
    """The repository's own Dagster instance with its storage on the pair (database `dagster`,
    the URL derived from the two-host DSN as `pin serve` derives it)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(SOURCE_ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", dagster_pg_url_from(pair.dsn))
    with dg.DagsterInstance.from_config(str(home)) as opened:
        yield opened


def test_planned_switchover_under_load_loses_repeats_and_reorders_nothing(
    pair: StreamingPair,
    topics: Topics,
    instance: dg.DagsterInstance,
    chdb_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Tried: migrate through the two-host DSN, seed, then run the writer, the drain, one
    long-lived relay and the loader concurrently; once each has done its work once, a planned
    switchover (the primary stopped with `-m fast`, the standby promoted). Each leg must
    succeed against the new primary within 30 s of the promotion, with no operator and no
    restart; `pin recalc drain --once` and `pin outbox relay --once` run as commands too. Then
    the writer stops, the rest drains, and the whole history of the module's topics is read:
    nothing lost, duplicated or reordered, the dimension holds every group's last Version and
    the aggregates equal the truth."""
    dsn = pair.dsn
    migrate_postgres(dsn)
    settings = Settings.from_env(
        {
            "PIN_PG_DSN": dsn,
            "PIN_CLICKHOUSE_URL": chdb_url,
            "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "PIN_STATE_DIR": str(tmp_path),
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-failover-{topics.suffix}",
        }
    )
    options = LoadOptions(
        topic=topics.private[TOPIC_LAYOUT_GROUP],
        dlq_topic=f"pin.test.dlq.{topics.suffix}",
        group=f"pin-test-failover-{topics.suffix}",
        attempts=3,
        backoff_seconds=0.2,
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        private_outbox(conn, topics)
        set_settings(conn, debounce="200 milliseconds", starvation_cap="1 second")
        seed(conn)

    writer = Writer(dsn)
    relay = OutboxRelay(settings, delivery_timeout=10.0, lock_timeout=10.0)
    legs = {
        "writer": Leg("writer", writer),
        "drain": Leg("drain", lambda: drain_tick(dsn)),
        "relay": Leg("relay", relay.run_once),
        "loader": Leg("loader", lambda: load_once(settings, options)),
        "dagster": Leg("dagster", lambda: _dagster_storage(instance)),
    }
    stop_writer, stop_rest = threading.Event(), threading.Event()
    threads = [
        threading.Thread(
            target=leg.run,
            args=(stop_writer if name == "writer" else stop_rest, 0.05),
            name=f"failover-{name}",
            daemon=True,
        )
        for name, leg in legs.items()
    ]
    for thread in threads:
        thread.start()
    try:
        wait_until(
            lambda: (
                (
                    len(legs["writer"].done) >= 60
                    and all(len(leg.done) >= 3 for leg in legs.values())
                )
                or bool(_crashed(legs))
            ),
            timeout=60,
            what="every leg's first steps",
        )
        pair.switchover()
        promoted = time.monotonic()
        wait_until(
            lambda: (
                all(leg.succeeded_after(promoted) for leg in legs.values()) or bool(_crashed(legs))
            ),
            timeout=RESUME_SECONDS + 5,
            what="every leg on the new primary",
        )
        assert not _crashed(legs), _crashed(legs)
        resumed = {name: leg.succeeded_after(promoted) for name, leg in legs.items()}
        assert all(s is not None and s < RESUME_SECONDS for s in resumed.values()), resumed
        wait_until(
            lambda: len([t for t in legs["writer"].done if t > promoted]) >= 60,
            timeout=60,
            what="edits on the new primary",
        )

        stop_writer.set()
        threads[0].join(timeout=30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(lambda: _settled(conn), timeout=60, what="the queue and outbox emptied")
    finally:
        stop_writer.set()
        stop_rest.set()
        for thread in threads:
            thread.join(timeout=60)
        relay.close()
        writer.close()
    assert not _crashed(legs), _crashed(legs)
    # The commands, as an operator runs them, on the new primary too (the relay's own lock is
    # free now that the long-lived one is closed).
    env = {"PIN_PG_DSN": dsn, "PIN_RELAY_TRANSACTIONAL_ID": settings.relay_transactional_id}
    assert "processed" in summary(run_pin("recalc", "drain", "--once", env=env))
    assert "published" in summary(run_pin("outbox", "relay", "--once", env=env))
    load_once(settings, options)  # the last events the relay published

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.info.port == pair.standby.target.port
        assert drift(conn) == {}
        for standard, own in topics.private.items():
            written = journal(conn, own)
            assert written, f"nothing written to {standard}"
            start = {own: dict.fromkeys(topic_end_offsets(kafka_bootstrap, [own])[own], 0)}
            reads = read_committed(kafka_bootstrap, start)
            dimension = (
                dimension_versions(chdb_url, {w.key for w in written})
                if standard == TOPIC_LAYOUT_GROUP
                else None
            )
            check(written, reads, dimension).assert_clean()


def _dagster_storage(instance: dg.DagsterInstance) -> None:
    """What every Dagster run and the daemon do: read and write the run storage (NullPool
    engines: a new connection each time, through libpq's host list)."""
    try:
        instance.get_runs_count()
        instance.run_storage.set_cursor_values({"pin-failover-test": str(time.time())})
    except Exception as exc:  # SQLAlchemy's OperationalError, whatever the driver said
        if type(exc).__name__ != "OperationalError":
            raise
        raise PinError(f"Dagster storage: {first_line(exc)}") from exc


def _crashed(legs: dict[str, Leg]) -> str:
    return "; ".join(f"{n} crashed: {leg.crashed!r}" for n, leg in legs.items() if leg.crashed)


def _settled(conn: psycopg.Connection) -> bool:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM chessboard.project_recalc_requests)"
        " + (SELECT count(*) FROM chessboard.outbox_events)"
    ).fetchone()
    return row is not None and row[0] == 0


def edit_areas(conn: psycopg.Connection, area: int) -> None:
    """Every layout's area changed: every project, group and layout gets a new Version."""
    conn.execute("UPDATE chessboard.layouts SET total_area = %s", (Decimal(area),))


def test_failover_to_a_lagging_standby_repeats_no_receipted_batch_and_reconcile_repairs(
    topics: Topics, ch: ClickHouse, chdb_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Tried: an asynchronous standby that stopped receiving WAL, then on the primary alone
    three relayed batches (the first of rows drained before the cut, two of edits made after
    it) and a load; the primary killed (`-m immediate`) and the standby promoted without them.
    The new primary's outbox holds the first batch's rows again and records none of the
    batches, and its outbox ids restart below the lost ones: an edit drained there before any
    relay runs gets ids the lost receipts name. The relay on the new primary must publish no
    receipted row again (it reads every receipt above the seq PostgreSQL recorded, not only
    the last) and must publish the new rows (a receipt covers only rows created up to its
    batch's newest); `pin reconcile` reports the groups whose Version in the dimension is
    beyond the new primary (`ahead_version`), and `--repair` converges the dimension. The
    events of batches 2 and 3 are what the exporter serves as beyond the source (the page)
    until the repair; before, nothing counted them."""
    with streaming_pair() as pair:
        dsn = pair.dsn
        migrate_postgres(dsn)
        settings = Settings.from_env(
            {
                "PIN_PG_DSN": dsn,
                "PIN_CLICKHOUSE_URL": chdb_url,
                "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
                "PIN_STATE_DIR": str(tmp_path),
                "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-failover-{topics.suffix}",
            }
        )
        options = LoadOptions(
            topic=topics.private[TOPIC_LAYOUT_GROUP],
            dlq_topic=f"pin.test.dlq.{topics.suffix}",
            group=f"pin-test-failover-{topics.suffix}",
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            private_outbox(conn, topics)
            seed(conn)
            drain_until_empty(conn, dsn)
            relay_once(settings)
            edit_areas(conn, 50)
            drain_until_empty(conn, dsn)  # rows the standby receives, published after the cut
            pair.cut_replication()
            held = relay_once(settings).published  # batch 1: rows the new primary will hold
            beyond = 0
            for area in (70, 80):  # batches 2 and 3: rows it will never have seen
                edit_areas(conn, area)
                drain_until_empty(conn, dsn)
                beyond += relay_once(settings).published
            load_once(settings, options)
            before = {own: journal(conn, own) for own in topics.private.values()}
        assert held > 0 and beyond > 0
        pair.fail_over()

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.info.port == pair.standby.target.port
            assert conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone() != (0,)
            edit_areas(conn, 90)
            drain_until_empty(conn, dsn)
            after = {own: journal(conn, own) for own in topics.private.values()}
        relay_once(settings)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Served as chessboard_outbox_events_beyond_source: CHESSBOARD_KAFKA_AHEAD_OF_SOURCE.
            assert events_beyond_source(conn) == beyond
        for own, old in before.items():
            old_ids = {w.event_id for w in old}
            new_ids = {w.event_id for w in after[own]} - old_ids
            start = {own: dict.fromkeys(topic_end_offsets(kafka_bootstrap, [own])[own], 0)}
            reads = read_committed(kafka_bootstrap, start)
            counts = Counter(r.event_id for r in reads)
            assert set(counts) == old_ids | new_ids and set(counts.values()) == {1}, (
                f"{own}: {len((old_ids | new_ids) - set(counts))} events lost,"
                f" {sum(n - 1 for n in counts.values())} published twice"
            )
            check(old, [r for r in reads if r.event_id in old_ids]).assert_clean()

        load_once(settings, options)
        found = reconcile(settings)
        groups = found.dim.checked
        assert found.dim.by_kind["ahead_version"] == groups == 2 * PROJECTS, found.as_dict()
        assert found.aggregates.summary()["projects_drifted"] == 0, found.as_dict()
        assert reconcile(settings, repair=True).repair == Repair(0, groups)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert events_beyond_source(conn) == 0  # the page resolves
        relay_once(settings)
        load_once(settings, options)
        healed = reconcile(settings).as_dict()
        assert (healed["projects_drifted"], healed["dim_rows_drifted"]) == (0, 0), healed
