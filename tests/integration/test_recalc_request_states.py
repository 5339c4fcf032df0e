"""A queue row's states written once (sql/postgres/schema/queue.sql: recalc_request_poisoned,
_due, _ready_at, _ready) and read through them everywhere: the claim, the next-due wait, the
poison view, the tick's count, the exporter's gauges. They agree on every kind of row, and the
claim still finds its row through the due_at index (the functions are inlined)."""

from __future__ import annotations

import json
import re
import uuid

import psycopg

from pin_pipelines.metrics.postgres import read_state
from pin_pipelines.recalc.drain import Q as RECALC
from tests.support.recalc import REPO_ROOT

#: Rows of every kind: (name, due_at offset s, attempt_count, attempted_at offset s, claimed).
#: The settings: poison_attempts 5, retry_interval 5 s (the defaults).
ROWS = [
    ("waiting", +60, 0, None, False),
    ("due", -30, 0, None, False),
    ("due, failed 10 s ago", -40, 1, -10, False),
    ("due, failed 1 s ago", -50, 1, -1, False),
    ("due, in a drain", -20, 0, -2, True),
    ("poisoned", -90, 5, -60, False),
]
STATES = ("recalc_request_poisoned", "recalc_request_due", "recalc_request_ready")


def _queue(conn: psycopg.Connection) -> dict[uuid.UUID, str]:
    names = {}
    for name, due, attempts, attempted, claimed in ROWS:
        project = uuid.uuid4()
        names[project] = name
        conn.execute(
            "INSERT INTO chessboard.project_recalc_requests (project_id, tenant_id, due_at,"
            " first_requested_at, last_reason, attempt_count, attempted_at, claimed_at)"
            " VALUES (%s, %s, now() + make_interval(secs => %s), now(), 'Manual', %s,"
            " now() + make_interval(secs => %s),"
            " CASE WHEN %s THEN now() + make_interval(secs => %s) END)",
            (project, uuid.uuid4(), due, attempts, attempted, claimed, attempted),
        )
    return names


def test_every_reader_of_the_queue_agrees_on_every_kind_of_row(db: psycopg.Connection) -> None:
    """Tried: one row of each kind (waiting for its debounce, due, failed and past its retry
    time, failed and within it, claimed by a drain, poisoned). Each state function says what the
    kind is; the poison view, the tick's count, the gauges and the next-due wait read the same;
    the claim takes the oldest ready row and then the other, and nothing more."""
    names = _queue(db)
    states = {
        names[project]: {state for state, holds in zip(STATES, row, strict=True) if holds}
        for project, *row in db.execute(
            "SELECT r.project_id, " + ", ".join(f"chessboard.{f}(r, s)" for f in STATES)
            + " FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s"
        )
    }  # fmt: skip
    assert states == {
        "waiting": set(),
        "due": {"recalc_request_due", "recalc_request_ready"},
        "due, failed 10 s ago": {"recalc_request_due", "recalc_request_ready"},
        "due, failed 1 s ago": {"recalc_request_due"},
        "due, in a drain": {"recalc_request_due"},
        "poisoned": {"recalc_request_poisoned"},
    }
    poisoned = db.execute("SELECT project_id FROM chessboard.poisoned_recalc_requests()")
    assert [names[p] for (p,) in poisoned] == ["poisoned"]
    assert RECALC.count_due_requests(db) == 4
    gauges = read_state(db)
    assert (gauges.depth, gauges.due_backlog, gauges.due_backlog_unpoisoned, gauges.poisoned) == (
        6, 5, 4, 1,
    )  # fmt: skip
    assert 49 < gauges.oldest_due_age_seconds < 52  # the row failed 1 s ago, due for 50 s
    (next_due,) = db.execute("SELECT chessboard.recalc_next_due_in_seconds()").fetchone() or ()
    assert next_due < -20  # ready now: "due" and "due, failed 10 s ago"
    claims = []
    for _ in range(3):  # the third finds nothing ready
        claims += [
            names[row[0]]
            for row in db.execute("SELECT * FROM chessboard.claim_due_request(%s)", ([],))
        ]
    assert claims == ["due, failed 10 s ago", "due"]


def test_the_claim_finds_its_row_through_the_due_at_index(db: psycopg.Connection) -> None:
    """Tried: the claim's query planned with sequential scans off. Its condition on due_at is an
    index condition of ix_project_recalc_due and no state function is called per row: the
    planner inlined them (a function it could not inline, say one made plpgsql, or one the
    caller may not EXECUTE, would be a filter run on every queued row)."""
    db.execute("SET enable_seqscan = off")
    (plan,) = (
        db.execute(
            "EXPLAIN (FORMAT JSON) SELECT r.project_id"
            " FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s"
            " WHERE chessboard.recalc_request_ready(r, s)"
            " ORDER BY r.due_at LIMIT 1 FOR UPDATE OF r SKIP LOCKED"
        ).fetchone()
        or ()
    )
    text = json.dumps(plan)
    assert re.search(r'"Index Name": "ix_project_recalc_due"', text), text
    assert re.search(r'"Index Cond": "\(due_at <= now\(\)\)"', text), text
    assert "recalc_request_" not in text, text


def test_no_query_spells_a_queue_state_out_again() -> None:
    """The poison threshold and the retry clock are compared in the state functions alone:
    no other statement of sql/postgres (schema, queries, grants) compares attempt_count with
    poison_attempts or adds retry_interval to attempted_at (the migrations keep their history)."""
    spelled = re.compile(
        r"attempt_count\s*[<>]=?\s*\w*\.?poison_attempts|attempted_at\s*\+\s*\w*\.?retry_interval"
    )
    found = []
    for path in sorted((REPO_ROOT / "sql/postgres").rglob("*.sql")):
        if "migrations" in path.parts:
            continue
        for line in path.read_text().splitlines():
            code = line.split("--", 1)[0]
            if spelled.search(code):
                found.append((path.relative_to(REPO_ROOT).as_posix(), line.strip()))
    assert found == [
        ("sql/postgres/schema/queue.sql", "SELECT r.attempt_count >= s.poison_attempts;"),
        (
            "sql/postgres/schema/queue.sql",
            "SELECT greatest(r.due_at, r.attempted_at + s.retry_interval);",
        ),
    ]
