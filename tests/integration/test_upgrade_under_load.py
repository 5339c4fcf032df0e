"""Upgrade under load (CONTRACT section 9): a release's `pin db migrate` runs while the previous
release's workers run; no run fails and no writer waits more than a second on it.

Everything here is the module's own: a PostgreSQL cluster, a Kafka broker and an embedded
ClickHouse folder in temporary folders on free ports (stopped by the finalizers whatever
happens), and the previous release (tests/support/release.py) installed in a venv of its own.
Nothing touches the shared services.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import dagster as dg
import psycopg
import pytest

from pin_pipelines.config import Settings, dsn_with_dbname
from pin_pipelines.kafka import ALL_TOPICS, CHANGELOG_TOPICS, TOPIC_LAYOUT_GROUP
from pin_pipelines.migrate import MIGRATION_LOCK_TIMEOUT_MS, PG_MIGRATIONS, migrate_postgres
from pin_pipelines.relay import topic_end_offsets
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.postgres import LocalPostgres
from pin_pipelines.stack.process import free_port, wait_until
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.history import Written, check, dimension_versions, read_committed
from tests.support.private_kafka import without_topics
from tests.support.recalc import PIN, REPO_ROOT, set_settings
from tests.support.release import (
    Release,
    install_release,
    newest_migration,
    previous_release,
    unreleased_migrations,
)
from tests.support.serve import (
    failure_messages,
    kill_session,
    serve_env,
    session_processes,
    start_serve,
)
from tests.support.truth import drift

#: The contract's bound on a writer's wait behind a migration.
WRITER_BOUND = 1.0
#: One edit every this many seconds.
EDIT_EVERY = 0.05
PROJECTS = 3
#: Every outbox row as committed (the relay deletes them): a test-only trigger's copy.
CAPTURE = """
CREATE TABLE public.test_outbox_written (
    id bigint PRIMARY KEY, topic text NOT NULL, message_key text NOT NULL,
    version int NOT NULL, event_id text);
CREATE FUNCTION public.test_outbox_written() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.test_outbox_written VALUES (NEW.id, NEW.topic, NEW.message_key,
        (NEW.payload->>'Version')::int, NEW.payload->>'EventId');
    RETURN NULL;
END $$;
CREATE TRIGGER test_outbox_written AFTER INSERT ON chessboard.outbox_events
    FOR EACH ROW EXECUTE FUNCTION public.test_outbox_written();
"""


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release: the commit before the newest migration's, in a venv of its own."""
    return install_release(previous_release(), tmp_path_factory.mktemp("previous-release"))


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A plain cluster of this module on a free port (its DSN's user its superuser), with the
    chessboard's and Dagster's databases; stopped whatever happens. Its folder is not pytest's
    (0700 up the path: the server's OS user could not reach its data)."""
    root = Path(tempfile.mkdtemp(prefix="pin-upgrade-pg-"))
    root.chmod(0o711)
    server = LocalPostgres(
        Settings.from_env(
            {
                "PIN_STATE_DIR": str(root),
                "PIN_PG_DSN": f"postgresql://pin@127.0.0.1:{free_port()}/pin",
            }
        )
    )
    try:
        server.up()
        yield server.settings.pg_dsn
    finally:
        server.down()
        shutil.rmtree(root, ignore_errors=True)


class Edits(threading.Thread):
    """An application's writes to the catalogue: every EDIT_EVERY, one commit changing a
    property object's price or status or a layout's area, round-robin over the projects. Each
    commit's latency (statement to commit, autocommit) is kept, with its phase."""

    def __init__(self, dsn: str, objects: list[UUID], layouts: list[UUID]) -> None:
        super().__init__(name="edits", daemon=True)
        self.dsn, self.objects, self.layouts = dsn, objects, layouts
        self.phase = "old release"
        #: When each phase began (time.monotonic()), for the test's report.
        self.began: dict[str, float] = {self.phase: time.monotonic()}
        self.latencies: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        # Bounded: a writer stuck behind a lock fails the test, it does not hang it.
        with psycopg.connect(self.dsn, autocommit=True, options="-c statement_timeout=30s") as c:
            n = 0
            while not self.stop.wait(EDIT_EVERY):
                n += 1
                statement, args = self._edit(n)
                began = time.monotonic()
                try:
                    c.execute(statement, args)
                except psycopg.Error as exc:
                    self.errors.append(f"{self.phase}: {exc}")
                    continue
                self.latencies.append((self.phase, time.monotonic() - began))

    def _edit(self, n: int) -> tuple[str, tuple[object, ...]]:
        kind, i = n % 3, n // 3
        if kind == 0:
            return (
                "UPDATE chessboard.property_objects SET price = price + 1 WHERE id = %s",
                (self.objects[i % len(self.objects)],),
            )
        if kind == 1 or not self.layouts:
            return (
                "UPDATE chessboard.property_objects"
                " SET status = CASE status WHEN 'Free' THEN 'Hidden' ELSE 'Free' END WHERE id = %s",
                (self.objects[i % len(self.objects)],),
            )
        return (
            "UPDATE chessboard.layouts SET total_area = total_area + 0.5 WHERE id = %s",
            (self.layouts[i % len(self.layouts)],),
        )

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.began[phase] = time.monotonic()

    def count(self) -> int:
        return len(self.latencies)


def _in_flight(instance: dg.DagsterInstance, since: float) -> bool:
    """A relay run, a load run and a drain run launched since `since`, each in flight (the drain
    goes on while edits keep the queue busy)."""
    jobs = ("outbox_relay_job", "dim_layout_group_job", "recalc_drain_job")
    started = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    return all(
        any(
            r.dagster_run.job_name == job and r.create_timestamp.timestamp() >= since
            for r in started
        )
        for job in jobs
    )


def _last_written(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT coalesce(max(id), 0) FROM public.test_outbox_written").fetchone()
    return int(row[0]) if row else 0


def _published_since(conn: psycopg.Connection, after: int) -> bool:
    """A drain wrote an event after outbox row `after`, and a relay published (and deleted) it."""
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM public.test_outbox_written w WHERE w.id > %s"
        " AND NOT EXISTS (SELECT FROM chessboard.outbox_events o WHERE o.id = w.id))",
        (after,),
    ).fetchone()
    return bool(row and row[0])


def _working(
    instance: dg.DagsterInstance, conn: psycopg.Connection, since: float, after: int
) -> bool:
    return _in_flight(instance, since) and _published_since(conn, after)


def _settled(conn: psycopg.Connection) -> bool:
    """No project queued, nothing left in the outbox, every aggregate equal to the truth."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM chessboard.project_recalc_requests)"
        " + (SELECT count(*) FROM chessboard.outbox_events)"
    ).fetchone()
    return row is not None and row[0] == 0 and not drift(conn)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    """What the test opens (a connection, the Dagster instance), closed after its finalizers."""
    with ExitStack() as opened:
        yield opened


def _catalogue(db: psycopg.Connection) -> tuple[list[UUID], list[UUID]]:
    """PROJECTS projects of a building, a layout group, two layouts and four objects each; the
    objects' and the layouts' ids."""
    objects, layouts = [], []
    for _ in range(PROJECTS):
        project = make_project(db)
        building = make_building(db, project)
        group = make_layout_group(db, project)
        for area in (30, 45):
            layout = make_layout(db, project, group, Decimal(area))
            layouts.append(layout)
            objects += [
                make_object(db, project, building, layout, price=Decimal(1000 + k))
                for k in range(2)
            ]
    return objects, layouts


def _failed_runs(instance: dg.DagsterInstance) -> list[tuple[str, list[str]]]:
    """Every run of the instance (both releases') that ended FAILURE, with its failures."""
    failed = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
    return [
        (r.dagster_run.job_name, failure_messages(e.dagster_event))
        for r in failed
        for e in instance.all_logs(r.dagster_run.run_id)
        if e.dagster_event and (e.dagster_event.is_step_failure or e.dagster_event.is_failure)
    ] or [(r.dagster_run.job_name, []) for r in failed]


def _stop(serve: subprocess.Popen[bytes], log: Path) -> None:
    """A clean stop (SIGTERM), as an operator's tools stop it; exits 0 within the grace."""
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=60)
    assert serve.returncode == 0, log.read_text()[-3000:]


def test_migrate_under_the_previous_releases_workers_then_replace_them(
    release: Release,
    postgres: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stack: ExitStack,
) -> None:
    """Tried: the previous release (the commit before the newest migration's) migrates an
    empty database and an empty broker, and its `pin serve` runs its drains, relay and loader
    while a writer commits an edit every 50 ms to three projects' objects and layouts. Then
    THIS release's `pin db migrate` runs (the newest migration, the grants, Dagster's storage
    grants, the snapshot topics made compacted) under those workers; the old `pin serve` is
    stopped with SIGTERM and this release's started on the same instance; the edits go on under
    it, then stop. Once the queue and the outbox are empty: no Dagster run of either release
    ended FAILURE, no edit waited a second or more, every aggregate equals the truth (so no
    edit's trigger was lost), and every snapshot event written reached Kafka exactly once and
    in Version order per key, the dimension at each group's last Version."""
    bootstrap = kafka.settings.kafka_bootstrap
    without_topics(bootstrap, ALL_TOPICS)  # the previous release makes its topics
    chdb_url = f"chdb://{tmp_path / 'chdb'}"
    home = tmp_path / "dagster_home"

    def env_of(**more: str) -> dict[str, str]:
        return serve_env(
            pg_dsn=postgres,
            dagster_db=dsn_with_dbname(postgres, "dagster"),
            kafka_bootstrap=bootstrap,
            clickhouse_url=chdb_url,
            home=home,
            PIN_STATE_DIR=str(tmp_path / "state"),
            PIN_RECALC_TICK_SECONDS="1",
            **more,
        )

    old_env, new_env = release.env(env_of()), env_of()
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", new_env["PIN_DAGSTER_PG_URL"])  # this instance

    migrated = subprocess.run(
        [release.pin, "db", "migrate"], cwd=release.root, env=old_env, capture_output=True
    )
    assert migrated.returncode == 0, migrated.stderr.decode()[-3000:]
    db = stack.enter_context(psycopg.connect(postgres, autocommit=True))
    db.execute(CAPTURE)
    set_settings(db, debounce="200 milliseconds", starvation_cap="2 seconds")
    edits = Edits(postgres, *_catalogue(db))
    old_log, new_log = tmp_path / "old-serve.log", tmp_path / "new-serve.log"
    old = start_serve(old_env, old_log, pin=release.pin, cwd=release.root)
    new: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: (home / "dagster.yaml").exists(), timeout=60, what="dagster.yaml")
        instance = stack.enter_context(dg.DagsterInstance.from_config(str(home)))
        edits.start()
        wait_until(
            lambda: _working(instance, db, 0, 0),
            timeout=120,
            what="the previous release's drain, relay and load at work",
            logfile=old_log,
        )
        # Every process of the old `pin serve` (daemon, webserver, code server, run workers)
        # runs the previous release's interpreter, so its package.
        assert [p for p in session_processes(old.pid) if str(Path(PIN).parent) in p] == []
        edits.enter("migrate")
        began = time.monotonic()
        upgraded = subprocess.run(
            [PIN, "db", "migrate"], cwd=REPO_ROOT, env=new_env, capture_output=True, text=True
        )
        migrate_seconds = time.monotonic() - began
        edits.enter("old release, migrated")
        assert upgraded.returncode == 0, upgraded.stderr[-3000:]
        summary = json.loads(upgraded.stdout.strip().splitlines()[-1])
        assert summary["postgres_applied"] == unreleased_migrations(), summary
        assert old.poll() is None, old_log.read_text()[-3000:]
        # The old workers go on working on the migrated schema.
        mark = _last_written(db)
        wait_until(
            lambda: _working(instance, db, 0, mark),
            timeout=60,
            what="the previous release's workers at work on the migrated schema",
            logfile=old_log,
        )
        edits.enter("replacing")
        _stop(old, old_log)
        replaced_at, mark = time.time(), _last_written(db)
        new = start_serve(new_env, new_log)
        wait_until(
            lambda: _working(instance, db, replaced_at, mark),
            timeout=120,
            what="this release's drain, relay and load at work",
            logfile=new_log,
        )
        edits.enter("new release")
        more = edits.count() + 40
        wait_until(lambda: edits.count() >= more, timeout=30, what="edits under this release")
        edits.enter("stopped")
        edits.stop.set()
        edits.join(timeout=60)
        wait_until(
            lambda: _settled(db),
            timeout=90,
            what="the queue and the outbox empty, the aggregates right",
            logfile=new_log,
        )
        captured = db.execute(
            "SELECT topic, message_key, version, event_id, id FROM public.test_outbox_written"
            " WHERE topic = ANY(%s) ORDER BY id",
            (list(CHANGELOG_TOPICS),),
        ).fetchall()
        left = drift(db)
        last: dict[str, int] = {}
        for topic, key, version, *_ in captured:
            if topic == TOPIC_LAYOUT_GROUP:
                last[key] = max(version, last.get(key, 0))
        wait_until(
            lambda: dimension_versions(chdb_url, last) == last,
            timeout=60,
            what="the dimension at each group's last Version",
            logfile=new_log,
        )
        _stop(new, new_log)
        failures = _failed_runs(instance)
    finally:
        edits.stop.set()
        for serve in (old, new):
            if serve is not None:
                kill_session(serve.pid)
                serve.wait(timeout=30)
    start = {
        topic: dict.fromkeys(parts, 0)
        for topic, parts in topic_end_offsets(bootstrap, list(CHANGELOG_TOPICS)).items()
    }
    reads = read_committed(bootstrap, start)
    worst: dict[str, float] = {}
    for phase, seconds in edits.latencies:
        worst[phase] = max(seconds, worst.get(phase, 0.0))
    order = sorted(edits.began.items(), key=lambda item: item[1])
    lasted = {p: round(b - a, 1) for (p, a), (_, b) in itertools.pairwise(order)}
    print(
        f"migrate took {migrate_seconds:.1f}s; {len(edits.latencies)} edits, the slowest per "
        f"phase {json.dumps({p: round(s, 3) for p, s in worst.items()})}; phases (s) {lasted}"
    )
    assert edits.errors == []
    assert "migrate" in worst, "no edit committed while the migration ran"
    assert max(worst.values()) < WRITER_BOUND, worst
    assert failures == []
    assert left == {}
    assert last, "no layout-group event written"
    written = [Written(key, version, event, i) for _, key, version, event, i in captured]
    check(written, reads).assert_clean()


#: A migration that needs ACCESS EXCLUSIVE on the busiest table (an instant ADD COLUMN, but it
#: must wait for every transaction that touched the table).
LOCKING_MIGRATION = "ALTER TABLE chessboard.property_objects ADD COLUMN test_note text;\n"


def test_a_migration_behind_a_long_transaction_never_holds_writers_up(
    postgres: str, tmp_path: Path
) -> None:
    """Tried: on a migrated database of its own, a reader's transaction that has read
    chessboard.property_objects stays open for 3 s while `migrate_postgres` applies a migration
    adding a column to that table and a writer updates an object every 50 ms. Before, the
    ALTER waited for the reader's whole transaction and every write queued behind it (3 s).
    Now each attempt gives up after MIGRATION_LOCK_TIMEOUT_MS and is tried again: no write
    waits a second, the migration is applied once the reader has ended, in one migrate."""
    dsn = dsn_with_dbname(postgres, "pin_lock_wait")
    with psycopg.connect(dsn_with_dbname(postgres, "postgres"), autocommit=True) as admin:
        admin.execute("CREATE DATABASE pin_lock_wait")
    migrate_postgres(dsn)
    folder = tmp_path / "migrations"
    shutil.copytree(PG_MIGRATIONS, folder)
    newest = newest_migration().stem
    (folder / "9999_test_note.sql").write_text(f"-- depends: {newest}\n{LOCKING_MIGRATION}")
    with psycopg.connect(dsn, autocommit=True) as db:
        project = make_project(db)
        objects = [make_object(db, project, make_building(db, project), None)]
    edits = Edits(dsn, objects, [])
    with psycopg.connect(dsn) as reader:
        reader.execute("SELECT count(*) FROM chessboard.property_objects")  # holds ACCESS SHARE
        edits.start()
        applied: list[str] = []
        migrating = threading.Thread(
            target=lambda: applied.extend(migrate_postgres(dsn, folder)), daemon=True
        )
        migrating.start()
        try:
            time.sleep(3)  # the long transaction (not an assertion)
        finally:
            reader.rollback()
        migrating.join(timeout=60)
    edits.stop.set()
    edits.join(timeout=30)
    assert applied == ["9999_test_note"]
    assert edits.errors == []
    slowest = max(seconds for _, seconds in edits.latencies)
    assert slowest < WRITER_BOUND, f"a write waited {slowest:.2f}s behind the migration"
    assert slowest * 1000 < MIGRATION_LOCK_TIMEOUT_MS + 300, slowest
