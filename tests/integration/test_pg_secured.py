"""PostgreSQL on a secured estate (CONTRACT section 8), against the secured server of the session's
estate (tests/support/secured.py: started once per session, met here as new, only its owner and
that owner's empty databases): TLS only (a certificate of the local CA, `verify-full`), SCRAM
passwords from a passfile, and an owner role that is no superuser (CREATEDB, CREATEROLE), as a
managed PostgreSQL hands it out.

`pin db migrate` runs as that owner; every other command, a Dagster run and `pin serve` run as a
login role holding only `pin_worker`, and `pin metrics serve` as one holding only `pin_reader`:
the least-privilege flow, run on the secured server itself (one server for both, to save time).
Then the failures an operator meets there, each in one line within 60 s, no password shown.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from pin_pipelines.config import SOURCE_ROOT, dagster_pg_url_from
from pin_pipelines.defs.recalc.jobs import recalc_drain_job
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.errors import PinError
from pin_pipelines.stack.postgres import LocalPostgres, scram_verifier
from pin_pipelines.stack.process import free_port, wait_until
from pin_pipelines.stack.tls import LocalCA
from tests.support.chessboard import make_building, make_layout, make_layout_group, make_object
from tests.support.chessboard import make_project as make_project_row
from tests.support.cli import assert_one_line_error, run_pin, summary
from tests.support.recalc import PIN, REPO_ROOT
from tests.support.serve import kill_session, start_serve
from tests.support.truth import drift

#: The secured estate (tests/support/secured.py) starts once per worker: its four modules run
#: one after another on one worker, so it starts once per run.
pytestmark = pytest.mark.xdist_group("secured")

WORKER, READER = "pin_w_login", "pin_r_login"
#: Each failure ends within this bound (CONTRACT section 8).
FAILURE_SECONDS = 60


@dataclass(frozen=True)
class Estate:
    """The module's secured server, migrated by its owner, with the two login roles; the state
    folder of the module's commands."""

    server: LocalPostgres
    state_dir: Path
    owner_dsn: str
    worker_dsn: str
    reader_dsn: str

    def env(self, dsn: str) -> dict[str, str]:
        """`pin`'s environment for `dsn`: Dagster's storage derived from it (not a variable of
        another test), this module's state folder and embedded dimension, its own relay id."""
        return {
            "PIN_PG_DSN": dsn,
            "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn),
            "PIN_STATE_DIR": str(self.state_dir),
            "PIN_CLICKHOUSE_URL": f"chdb://{self.state_dir / 'chdb'}",
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-secured-{self.state_dir.name}",
        }


@pytest.fixture(scope="module")
def estate(secured_postgres: LocalPostgres) -> Iterator[Estate]:
    """The secured server (TLS, SCRAM, the owner `pin` and its empty databases; stopped at the
    session's end); `pin db migrate` run as the owner; the worker's and the reader's login
    roles made by the owner (CREATEROLE) with passwords in the passfile. The commands' state
    folder is the module's own, its name unique (their relay's transactional id on the shared
    broker is made of it), removed after."""
    server = secured_postgres
    state_dir = Path(tempfile.mkdtemp(prefix="pin-secured-pg-"))
    try:
        owner = server.client_dsn()
        estate = Estate(
            server, state_dir, owner, server.client_dsn(WORKER), server.client_dsn(READER)
        )
        migrated = run_pin("db", "migrate", env=estate.env(owner))
        assert migrated.returncode == 0, migrated.stderr
        with psycopg.connect(owner, autocommit=True) as conn:
            for role, group in ((WORKER, "pin_worker"), (READER, "pin_reader")):
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                        sql.Identifier(role),
                        scram_verifier(conn, role, server.password(role)),
                        sql.Identifier(group),
                    )
                )
        yield estate
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def make_project(conn: psycopg.Connection) -> uuid.UUID:
    """A project of one building, one layout and two objects (one free), written as the
    catalogue writes (the triggers queue it)."""
    project = make_project_row(conn)
    building = make_building(conn, project)
    layout = make_layout(conn, project, make_layout_group(conn, project), 40)
    make_object(conn, project, building, layout, status="Free", price=1000)
    make_object(conn, project, building, layout, status="Sold", price=3000)
    return project


def test_the_owner_migrates_over_verified_tls_as_no_superuser(estate: Estate) -> None:
    """Tried: what the module's `pin db migrate` left, read as the owner. The session is TLS
    (pg_stat_ssl), the owner no superuser; the group roles exist, NOLOGIN; pin_worker may use
    the schema but not create in it, nor in public; a second migrate applies nothing and
    re-applies the grants. `up` again finds it running (idempotent), `status` says so; the plain
    stack's `up` on its folder refuses in one line instead of turning it plain."""
    assert estate.server.up()["state"] == "already running"
    assert estate.server.status()["state"] == "running"
    with pytest.raises(PinError, match="was made secure, not plain"):
        LocalPostgres(estate.server.settings).up()
    with psycopg.connect(estate.owner_dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        ).fetchone() == (True,)
        assert conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (False,)
        roles = conn.execute(
            "SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'pin\\_%%er'"
            " ORDER BY rolname"
        ).fetchall()
        assert roles == [("pin_reader", False), ("pin_worker", False)]
        privileges = conn.execute(
            "SELECT has_schema_privilege('pin_worker', 'chessboard', 'USAGE'),"
            " has_schema_privilege('pin_worker', 'chessboard', 'CREATE'),"
            " has_schema_privilege('pin_worker', 'public', 'CREATE'),"
            " has_table_privilege('pin_reader', 'chessboard.projects', 'INSERT')"
        ).fetchone()
        assert privileges == (True, False, False, False)
    again = summary(run_pin("db", "migrate", env=estate.env(estate.owner_dsn)))
    assert again["postgres_applied"] == []


def test_the_worker_runs_every_command_and_no_ddl(estate: Estate) -> None:
    """Tried, as a login role holding only pin_worker: an edit (written as the worker, the
    triggers queue it), `pin recalc request`, `pin recalc drain --once` (the project's
    aggregates right), `pin outbox relay --once` (its events published), `pin reconcile` (no
    drift), a poisoned row's `pin recalc requeue`; then DDL as the worker (CREATE TABLE in
    chessboard and public, ALTER, DROP), each refused; and `pin db migrate` as the worker, which
    ends in one line naming the cause, no traceback, no password."""
    env = estate.env(estate.worker_dsn)
    with psycopg.connect(estate.worker_dsn, autocommit=True) as conn:
        project = make_project(conn)
        summary(run_pin("recalc", "request", "--project-id", str(project), env=env))
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
        drained = summary(run_pin("recalc", "drain", "--once", env=env))
        assert (drained["processed"], drained["failed"]) == (1, 0), drained
        assert conn.execute(
            "SELECT property_objects_total_count, property_objects_free_count"
            " FROM chessboard.projects WHERE id = %s",
            (project,),
        ).fetchone() == (2, 1)
        assert drift(conn) == {}
        assert summary(run_pin("outbox", "relay", "--once", env=env))["published"] >= 1
        reconciled = summary(run_pin("reconcile", env=env))
        assert reconciled["projects_checked"] >= 1 and reconciled["projects_drifted"] == 0
        summary(run_pin("recalc", "request", "--project-id", str(project), env=env))
        conn.execute(
            "UPDATE chessboard.project_recalc_requests SET attempt_count = 5,"
            " last_error = 'bad data' WHERE project_id = %s",
            (project,),
        )
        summary(run_pin("recalc", "requeue", "--project-id", str(project), env=env))
        assert conn.execute(
            "SELECT attempt_count, last_error FROM chessboard.project_recalc_requests"
            " WHERE project_id = %s",
            (project,),
        ).fetchone() == (0, None)
        for ddl in (
            "CREATE TABLE chessboard.intruder (id int)",
            "CREATE TABLE public.intruder (id int)",
            "ALTER TABLE chessboard.projects ADD COLUMN intruder int",
            "DROP TABLE chessboard.outbox_events",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(ddl)
    refused = run_pin("db", "migrate", env=env)
    assert_one_line_error(refused, f"{WORKER} may not migrate the schema", "schema's owner")
    assert estate.server.password(WORKER) not in refused.stderr + refused.stdout


def test_the_reader_serves_metrics_and_writes_nothing(estate: Estate) -> None:
    """Tried, as a login role holding only pin_reader: `pin metrics serve` answers /metrics with
    the chessboard's metrics read from PostgreSQL (source up, the queue's gauges, the relay's
    backlog); an INSERT, an UPDATE and a DELETE of its own are refused."""
    port = free_port()
    process = subprocess.Popen(
        [PIN, "metrics", "serve", "--port", str(port)],
        cwd=REPO_ROOT,
        env={**os.environ, **estate.env(estate.reader_dsn)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    text = ""
    try:

        def scraped() -> bool:
            nonlocal text
            assert process.poll() is None, process.communicate()[1]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    text = r.read().decode()
            except OSError:
                return False
            return True

        wait_until(scraped, timeout=30, what="pin metrics serve as the reader")
    finally:
        process.terminate()
        process.communicate(timeout=10)
    assert 'pin_metrics_source_up{source="postgres"} 1.0' in text
    assert "chessboard_recalc_queue_depth" in text
    with psycopg.connect(estate.reader_dsn, autocommit=True) as conn:
        for write in (
            "INSERT INTO chessboard.recalc_scheduler_beats DEFAULT VALUES",
            "UPDATE chessboard.recalc_settings SET debounce = debounce",
            "DELETE FROM chessboard.project_recalc_requests",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(write)


def test_a_dagster_drain_run_as_the_worker_keeps_its_password_out_of_dagster(
    estate: Estate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: recalc_drain_job executed in process on an instance of the repository's
    dagster.yaml whose storage is the secured server's `dagster` database (tables made by the
    owner's migrate), as the worker, with its password in both URLs this time (not the
    passfile). The run succeeds and drains the project; the password is in none of the run's
    config, tags or event log."""
    password = estate.server.password(WORKER)
    dsn = estate.worker_dsn.replace(f"//{WORKER}@", f"//{WORKER}:{password}@").replace(
        f"&passfile={estate.server.passfile}", ""
    )
    assert "passfile" not in dsn
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(SOURCE_ROOT / "dagster.yaml", home / "dagster.yaml")
    for name, value in estate.env(dsn).items():
        monkeypatch.setenv(name, value)
    with psycopg.connect(estate.worker_dsn, autocommit=True) as conn:
        project = make_project(conn)
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            result = recalc_drain_job.execute_in_process(
                run_config={"ops": {"drain_recalc_queue": {"config": {"budget_seconds": 2.0}}}},
                resources=RESOURCES,
                instance=instance,
            )
            assert result.success
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            recorded = repr((run.run_config, run.tags)) + "".join(
                repr(entry) for entry in instance.all_logs(result.run_id)
            )
        assert conn.execute(
            "SELECT count(*) FROM chessboard.project_recalc_requests WHERE project_id = %s",
            (project,),
        ).fetchone() == (0,)
    assert password not in recorded


def test_pin_serve_as_the_worker_launches_a_drain_run_that_succeeds(
    estate: Estate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: `pin serve` as the worker on the secured server (Dagster's storage there too),
    Kafka at a closed port so its relay and load runs never touch the shared broker; a project
    becomes due. The recalc sensor launches a drain run that ends SUCCESS and drains it; a
    SIGTERM stops `pin serve` with exit status 0."""
    home = tmp_path / "dagster_home"
    env = {
        **os.environ,
        **estate.env(estate.worker_dsn),
        "DAGSTER_HOME": str(home),
        "PIN_DAGSTER_PORT": str(free_port()),
        "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
    }
    storage = env["PIN_DAGSTER_PG_URL"]
    log = tmp_path / "serve.log"
    serve = start_serve(env, log)
    try:
        wait_until(lambda: (home / "dagster.yaml").exists(), timeout=30, what="dagster.yaml")
        with psycopg.connect(estate.worker_dsn, autocommit=True) as conn:
            project = make_project(conn)
            conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
            monkeypatch.setenv("PIN_DAGSTER_PG_URL", storage)  # for this test's instance
            with dg.DagsterInstance.from_config(str(home)) as instance:
                before = {r.run_id for r in instance.get_runs()}

                def drained() -> bool:
                    assert serve.poll() is None, log.read_text()[-3000:]
                    runs = instance.get_runs(
                        dg.RunsFilter(
                            job_name=recalc_drain_job.name,
                            statuses=[dg.DagsterRunStatus.SUCCESS],
                        )
                    )
                    queued = conn.execute(
                        "SELECT count(*) FROM chessboard.project_recalc_requests"
                        " WHERE project_id = %s",
                        (project,),
                    ).fetchone()
                    return any(r.run_id not in before for r in runs) and queued == (0,)

                wait_until(drained, timeout=120, what="a drain run of pin serve")
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
        assert serve.returncode == 0, log.read_text()[-3000:]
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("wrong password", 'authentication failed for user "pin_w_login"'),
        ("untrusted certificate", "certificate not trusted"),
        ("plaintext", "the server requires TLS"),
    ],
)
def test_a_refused_connection_ends_in_one_line_without_the_password(
    estate: Estate, tmp_path: Path, case: str, words: str
) -> None:
    """Tried: `pin recalc drain --once` as the worker with a wrong password in the URL, with the
    sslrootcert of another CA, and with sslmode=disable at the TLS-only server. Each exits
    non-zero within 60 s with one line naming PostgreSQL at the redacted URL and the cause in
    an operator's words, followed by the server's own line; no password anywhere."""
    wrong = f"not-{uuid.uuid4().hex}"
    dsn = {
        "wrong password": estate.worker_dsn.replace(f"//{WORKER}@", f"//{WORKER}:{wrong}@").replace(
            f"&passfile={estate.server.passfile}", ""
        ),
        "untrusted certificate": estate.worker_dsn.replace(
            str(estate.server.ca.cert), str(LocalCA(tmp_path / "other", "another CA").ensure().cert)
        ),
        "plaintext": estate.worker_dsn.replace("sslmode=verify-full", "sslmode=disable"),
    }[case]
    assert dsn != estate.worker_dsn
    started = time.monotonic()
    result = run_pin("recalc", "drain", "--once", env=estate.env(dsn), timeout=FAILURE_SECONDS)
    assert time.monotonic() - started < FAILURE_SECONDS
    assert_one_line_error(result, "PostgreSQL at postgresql://pin_w_login", words)
    output = result.stdout + result.stderr
    assert wrong not in output and estate.server.password(WORKER) not in output
