"""Helpers for the recalc tests: queue settings, queue rows, outbox reads and test-only triggers
that make a project's recalc slow or fail for real (always dropped afterwards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import psycopg.sql

from pin_pipelines.recalc.drain import TickSummary, drain_tick
from tests.support.chessboard import make_all_due
from tests.support.contracts import assert_in_contract

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN = str(Path(sys.executable).with_name("pin"))


def set_settings(conn: psycopg.Connection, **values: Any) -> None:
    """e.g. set_settings(db, debounce="1 second", starvation_cap="5 seconds")."""
    assignments = ", ".join(f"{name} = %({name})s" for name in values)
    conn.execute(f"UPDATE chessboard.recalc_settings SET {assignments}", values)


def queue_row(conn: psycopg.Connection, project_id: UUID) -> dict[str, Any] | None:
    cur = conn.execute(
        "SELECT * FROM chessboard.project_recalc_requests WHERE project_id = %s", (project_id,)
    )
    row = cur.fetchone()
    if row is None:
        return None
    return dict(zip([d.name for d in cur.description or []], row, strict=True))


def queued_projects(conn: psycopg.Connection) -> dict[UUID, dict[str, Any]]:
    cur = conn.execute("SELECT * FROM chessboard.project_recalc_requests")
    names = [d.name for d in cur.description or []]
    return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}


def clear_queue(conn: psycopg.Connection) -> None:
    conn.execute("DELETE FROM chessboard.project_recalc_requests")


def outbox(conn: psycopg.Connection, key: UUID | None = None) -> list[tuple[str, str, dict]]:
    """(topic, message_key, payload) in commit order, optionally only one entity's events; each
    payload keeps its topic's contract (checked here: every test of the drain checks the SQL
    that builds them)."""
    rows = conn.execute(
        "SELECT topic, message_key, payload FROM chessboard.outbox_events ORDER BY id"
    ).fetchall()
    for topic, _, payload in rows:
        assert_in_contract(topic, payload)
    return [(t, k, p) for t, k, p in rows if key is None or k == str(key)]


def drain_due(dsn: str, conn: psycopg.Connection, **kwargs: Any) -> TickSummary:
    """Skip the debounce wait, then run one worker tick."""
    make_all_due(conn)
    return drain_tick(dsn, **kwargs)


def drain_all(dsn: str, conn: psycopg.Connection) -> list[TickSummary]:
    """Ticks until a tick finds nothing ready."""
    ticks = []
    while True:
        tick = drain_due(dsn, conn)
        ticks.append(tick)
        if not tick.results:
            return ticks


def drain_until_empty(conn: psycopg.Connection, dsn: str) -> None:
    """Make every queue row due now and drain until the queue is empty (the consistent state)."""
    for _ in range(1000):
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
        if not drain_tick(dsn, batch_size=500).results:
            break
    left = conn.execute("SELECT count(*) FROM chessboard.project_recalc_requests").fetchone()
    assert left == (0,)


@contextmanager
def failing_recalc(conn: psycopg.Connection, project_id: UUID, message: str) -> Iterator[None]:
    """A test-only trigger that RAISEs when the drain writes this project's aggregates: the
    project's recalc fails for real, inside its own transaction."""
    with _test_trigger(
        conn,
        "test_fail_recalc",
        "projects",
        f"IF NEW.id = '{project_id}'::uuid THEN"
        f" RAISE EXCEPTION USING MESSAGE = {psycopg.sql.quote(message)}; END IF;",
    ):
        yield


@contextmanager
def failing_on_request(conn: psycopg.Connection) -> Iterator[None]:
    """A test-only trigger that RAISEs when a queue row's request count goes up, i.e. when a
    raiser enqueues a project that is already queued. Inside a drain's project transaction the
    row is the one being drained, so a raiser fired by the drain's own writes fails that project
    (which the drain's later delete of the row would otherwise hide)."""
    with _test_trigger(
        conn,
        "test_fail_on_request",
        "project_recalc_requests",
        "IF NEW.requested_count > OLD.requested_count THEN"
        " RAISE EXCEPTION 'a recalc request was raised for %', NEW.project_id; END IF;",
    ):
        yield


@contextmanager
def slow_recalc(
    conn: psycopg.Connection,
    seconds: float,
    table: str = "projects",
    project_id: UUID | None = None,
) -> Iterator[None]:
    """A test-only trigger that sleeps whenever the drain writes a row of `table` (the project's
    aggregates by default; of `project_id` only, when given), so a recalc lasts long enough for
    another process to act while it is in flight."""
    sleep = f"PERFORM pg_sleep({float(seconds)});"
    if project_id is not None:
        key = "id" if table == "projects" else "project_id"
        sleep = f"IF NEW.{key} = '{project_id}'::uuid THEN {sleep} END IF;"
    with _test_trigger(conn, "test_slow_recalc", table, sleep):
        yield


@contextmanager
def _test_trigger(conn: psycopg.Connection, name: str, table: str, body: str) -> Iterator[None]:
    """A BEFORE UPDATE row trigger `name` on chessboard.<table> running `body`, dropped on exit."""
    conn.execute(
        f"""
        CREATE OR REPLACE FUNCTION chessboard.{name}() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            {body}
            RETURN NEW;
        END $$;
        CREATE TRIGGER {name} BEFORE UPDATE ON chessboard.{table}
            FOR EACH ROW EXECUTE FUNCTION chessboard.{name}();
        """
    )
    try:
        yield
    finally:
        conn.execute(f"DROP TRIGGER IF EXISTS {name} ON chessboard.{table}")
        conn.execute(f"DROP FUNCTION IF EXISTS chessboard.{name}()")


@contextmanager
def server_edit(
    conn: psycopg.Connection,
    dsn: str,
    *edits: str,
    on: str,
    when: str,
    table: str = "project_recalc_requests",
) -> Iterator[None]:
    """While inside: the first row of chessboard.<table> that an AFTER `on` (UPDATE or DELETE)
    row trigger meets with the plpgsql condition `when` (on OLD and NEW) sends each of `edits`,
    in order, to a session of its own (dblink) and goes on once that session waits for a lock
    (or after 5 s): edits that arrive from the server at that very point of the drain's
    transaction. The sessions belong to the drain's backend: they end with its connection."""
    body = f"""
        IF NOT ({when})
           OR 'server_edit_1' = ANY(coalesce(dblink_get_connections(), '{{}}')) THEN
            RETURN NULL;
        END IF;
        FOREACH v_edit IN ARRAY {_text_array(edits)} LOOP
            v_n := v_n + 1;
            PERFORM dblink_connect('server_edit_' || v_n, {psycopg.sql.quote(dsn)});
            SELECT t.pid INTO v_pid
            FROM dblink('server_edit_' || v_n, 'SELECT pg_backend_pid()') AS t(pid int);
            PERFORM dblink_send_query('server_edit_' || v_n, v_edit);
            FOR i IN 1..500 LOOP
                -- pg_stat_activity is read once per transaction unless its snapshot is cleared.
                PERFORM pg_stat_clear_snapshot();
                EXIT WHEN EXISTS (SELECT 1 FROM pg_stat_activity a
                                  WHERE a.pid = v_pid AND a.wait_event_type = 'Lock');
                PERFORM pg_sleep(0.01);
            END LOOP;
        END LOOP;
        RETURN NULL;
    """
    conn.execute(
        f"""
        CREATE EXTENSION IF NOT EXISTS dblink;
        CREATE FUNCTION chessboard.test_server_edit() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE v_pid int; v_edit text; v_n int := 0;
        BEGIN {body} END $$;
        CREATE TRIGGER test_server_edit AFTER {on} ON chessboard.{table}
            FOR EACH ROW EXECUTE FUNCTION chessboard.test_server_edit();
        """
    )
    try:
        yield
    finally:
        conn.execute(f"DROP TRIGGER test_server_edit ON chessboard.{table}")
        conn.execute("DROP FUNCTION chessboard.test_server_edit()")
        conn.execute("DROP EXTENSION dblink")


def _text_array(items: tuple[str, ...]) -> str:
    """A plpgsql text[] literal of `items`."""
    return "ARRAY[" + ", ".join(psycopg.sql.quote(item) for item in items) + "]::text[]"


def claim_hook(
    conn: psycopg.Connection, project: UUID, dsn: str, *edits: str
) -> AbstractContextManager[None]:
    """server_edit at the first claim of `project` (the claim's UPDATE sets claimed_at)."""
    return server_edit(
        conn,
        dsn,
        *edits,
        on="UPDATE",
        when=f"NEW.project_id = '{project}' AND NEW.claimed_at IS NOT NULL"
        " AND OLD.claimed_at IS NULL",
    )


def claimed_row_taken_over(
    conn: psycopg.Connection, project: UUID, dsn: str, hold_seconds: float
) -> AbstractContextManager[None]:
    """At the first claim of `project`, a writer takes the claimed row before the drain's work
    can lock it again, and holds it `hold_seconds` (then commits): a raiser's upsert whose edit
    runs long. The writer's FOR UPDATE queues on the row while the claim's transaction holds it;
    a second session then asks for the queue table in EXCLUSIVE mode (queued behind the claim and
    the writer, for 300 ms at most), which the work's lock of the row queues behind: when the
    claim commits, the writer takes the row while the work waits, every time. The EXCLUSIVE
    request gives up long before the writer ends, so nothing else of the queue waits for it.
    The writer is a session of the drain's backend (server_edit): the drain's connection must
    stay open until it has committed."""
    writer = (
        "BEGIN; SELECT 1 FROM chessboard.project_recalc_requests"
        f" WHERE project_id = '{project}' FOR UPDATE;"
        " SELECT chessboard.request_project_recalc(id, tenant_id, 'Crud')"
        f" FROM chessboard.projects WHERE id = '{project}';"
        f" SELECT pg_sleep({float(hold_seconds)}); COMMIT;"
    )
    queue_blocker = (
        "SET lock_timeout = '300ms';"
        " LOCK TABLE chessboard.project_recalc_requests IN EXCLUSIVE MODE"
    )
    return claim_hook(conn, project, dsn, writer, queue_blocker)


def counter(conn: psycopg.Connection, metric: str, label: str = "") -> float:
    """A drain counter as the exporter serves it (chessboard.metric_counter_rows: the folded
    counters and the outcome rows not folded yet), e.g. counter(db, "runs", "error")."""
    row = conn.execute(
        "SELECT coalesce(sum(value), 0) FROM chessboard.metric_counter_rows"
        " WHERE metric = %s AND label = %s",
        (metric, label),
    ).fetchone()
    return float(row[0]) if row else 0.0


def pending_claim_ends(conn: psycopg.Connection) -> list[tuple[UUID, str | None]]:
    """(project_id, error) of the attempts' ends a writer kept from their rows (migration 0021)."""
    rows = conn.execute(
        "SELECT project_id, error FROM chessboard.recalc_pending_claim_ends ORDER BY claimed_at"
    ).fetchall()
    return [(project, error) for project, error in rows]


def sleeping_backends(conn: psycopg.Connection) -> int:
    """Backends currently inside the slow trigger's pg_sleep."""
    return _backends_waiting(conn, "wait_event = 'PgSleep'")


def lock_waiters(conn: psycopg.Connection) -> int:
    """Backends waiting for a row or table lock."""
    return _backends_waiting(conn, "wait_event_type = 'Lock'")


def _backends_waiting(conn: psycopg.Connection, condition: str) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM pg_stat_activity WHERE {condition} AND datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def pin_env(dsn: str) -> dict[str, str]:
    return {**os.environ, "PIN_PG_DSN": dsn}


def start_pin(dsn: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """A real `pin` process (its own interpreter and connections); `env` adds settings."""
    return subprocess.Popen(
        [PIN, *args],
        cwd=REPO_ROOT,
        env={**pin_env(dsn), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def last_json_line(stdout: str) -> dict[str, Any]:
    """The contract's JSON summary: the last line on stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output on stdout"
    return json.loads(lines[-1])
