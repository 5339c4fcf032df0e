"""Spec 000, concurrency and cancellation, with real worker processes (`pin recalc drain --once`
in its own interpreter), real writer sessions and a test-only trigger that makes each project's
recalc slow."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.recalc import drain
from pin_pipelines.recalc.drain import drain_tick
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.recalc import (
    claim_hook,
    counter,
    last_json_line,
    lock_waiters,
    outbox,
    queue_row,
    queued_projects,
    sleeping_backends,
    slow_recalc,
    start_pin,
)
from tests.support.truth import actual_aggregates, expected_aggregates, versions


def _populated_project(conn: psycopg.Connection, free_price: int) -> dict[str, UUID]:
    project = make_project(conn)
    building = make_building(conn, project)
    group = make_layout_group(conn, project)
    layout = make_layout(conn, project, group, 42)
    make_object(conn, project, building, layout, status="Free", price=free_price)
    make_object(conn, project, building, layout, status="Booked", price=free_price * 2)
    return {"project": project, "building": building, "group": group, "layout": layout}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[dict, str, float]:
    """Wait for a worker; returns its JSON summary, its stderr and when it exited."""
    stdout, stderr = proc.communicate(timeout=timeout)
    ended = time.monotonic()
    assert proc.returncode == 0, stderr
    return last_json_line(stdout), stderr, ended


def test_two_workers_on_one_row_recalculate_it_exactly_once(db, pg_dsn):
    """Two `pin recalc drain --once` processes started together on one due row whose recalc
    sleeps 2 s: one recalculates it, the other sees the due row, skips it without waiting
    (SKIP LOCKED, it exits while the first is still sleeping) and processes nothing; the
    project's version is bumped once and one project event is written."""
    tree = _populated_project(db, 100)
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '1 second'")
    with slow_recalc(db, 2.0):
        procs = [start_pin(pg_dsn, "recalc", "drain", "--once") for _ in range(2)]
        _wait_for(lambda: sleeping_backends(db) == 1, 15, "one worker inside the recalc")
        finished = {}
        deadline = time.monotonic() + 30
        while len(finished) < 2 and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if i not in finished and proc.poll() is not None:
                    finished[i] = _finish(proc)
                    if len(finished) == 1:
                        # The first to exit must be the skipper, while the winner still sleeps.
                        assert sleeping_backends(db) == 1
            time.sleep(0.01)
        assert len(finished) == 2, "a worker did not finish"

    summaries = {i: summary for i, (summary, _, _) in finished.items()}
    assert sorted(s["processed"] for s in summaries.values()) == [0, 1]
    assert sum(s["failed"] for s in summaries.values()) == 0
    loser = next(i for i, s in summaries.items() if s["processed"] == 0)
    winner = 1 - loser
    assert summaries[loser]["due_at_start"] == 1  # the row was due, and skipped, not missed
    assert finished[loser][2] < finished[winner][2]
    assert queue_row(db, tree["project"]) is None
    assert versions(db)["projects"][tree["project"]] == 2
    assert len(outbox(db, tree["project"])) == 1


def test_sigterm_mid_batch_stops_gracefully_leaving_no_project_half_done(db, pg_dsn):
    """`pin recalc drain --once` over 4 due projects whose recalc sleeps 0.8 s each gets SIGTERM
    while the second project is being recalculated: it exits 0 with stopped_early true; the
    projects it got to are fully recalculated (row deleted, aggregates equal the truth, events
    written, one project_recalculated log line each) and the others are untouched (row queued,
    attempt_count 0, version 1, no event)."""
    trees = [_populated_project(db, 100 * (i + 1)) for i in range(4)]
    for order, tree in enumerate(trees):
        db.execute(
            "UPDATE chessboard.project_recalc_requests"
            " SET due_at = now() - make_interval(secs => %s) WHERE project_id = %s",
            (10 - order, tree["project"]),
        )
    with slow_recalc(db, 0.8):
        proc = start_pin(pg_dsn, "recalc", "drain", "--once")
        _wait_for(
            lambda: queue_row(db, trees[0]["project"]) is None and sleeping_backends(db) == 1,
            20,
            "the worker to be inside the second project's recalc",
        )
        proc.send_signal(signal.SIGTERM)
        summary, stderr, _ = _finish(proc)

    assert summary["stopped_early"] is True
    assert summary["failed"] == 0
    assert summary["processed"] == 2
    queued = queued_projects(db)
    expected, actual, current = expected_aggregates(db), actual_aggregates(db), versions(db)
    done = [t for t in trees if t["project"] not in queued]
    assert [t["project"] for t in done] == [t["project"] for t in trees[:2]]
    for tree in trees:
        if tree in done:
            for table, key in (
                ("projects", "project"),
                ("buildings", "building"),
                ("layouts", "layout"),
                ("layout_groups", "group"),
            ):
                assert actual[table][tree[key]] == expected[table][tree[key]], table
                assert current[table][tree[key]] == 2, table
            assert outbox(db, tree["project"])
        else:
            assert queued[tree["project"]]["attempt_count"] == 0
            for table, key in (
                ("projects", "project"),
                ("buildings", "building"),
                ("layouts", "layout"),
                ("layout_groups", "group"),
            ):
                assert current[table][tree[key]] == 1, table
            assert actual["projects"][tree["project"]] == (None, None, 0, 0)
            assert not outbox(db, tree["project"])
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert events.count("recalc_batch_started") == 1
    assert events.count("project_recalculated") == 2
    assert "project_recalc_failed" not in events


def _due_project_and_free_object(db: psycopg.Connection) -> tuple[dict[str, UUID], UUID]:
    """A populated project due now, and its Free object (the API edits its price)."""
    tree = _populated_project(db, 100)
    [(free_object,)] = db.execute(
        "SELECT id FROM chessboard.property_objects WHERE project_id = %s AND status = 'Free'",
        (tree["project"],),
    ).fetchall()
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '1 second'")
    return tree, free_object


def test_a_lock_cycle_the_drain_enters_first_defers_the_project(db, pg_dsn):
    """Tried: an API-like transaction locks the project row; a `pin recalc drain --once` process
    claims the project's queue row and waits for that lock; the API then edits an object's price,
    so its raiser waits for the queue row the drain holds: a lock cycle. The drain's lock_timeout
    (half of deadlock_timeout) ends its wait first: the project is deferred (no attempt counted;
    with a 2 s lock_timeout the deadlock detector failed the drain instead, an attempt towards
    poison); the edit commits; the next tick recalculates the project with the new price."""
    tree, free_object = _due_project_and_free_object(db)

    with psycopg.connect(pg_dsn) as api:
        api.execute(
            "SELECT 1 FROM chessboard.projects WHERE id = %s FOR UPDATE", (tree["project"],)
        )
        proc = start_pin(pg_dsn, "recalc", "drain", "--once")
        _wait_for(lambda: lock_waiters(db) == 1, 15, "the drain waiting for the project row")
        api.execute(
            "UPDATE chessboard.property_objects SET price = 60 WHERE id = %s", (free_object,)
        )
        api.commit()
    summary, _, _ = _finish(proc)

    assert (summary["processed"], summary["deferred"], summary["failed"]) == (0, 1, 0)
    row = queue_row(db, tree["project"])
    assert row is not None and row["attempt_count"] == 0 and row["last_error"] is None
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '1 second'")
    summary, _, _ = _finish(start_pin(pg_dsn, "recalc", "drain", "--once"))
    assert summary["processed"] == 1
    expected, actual = expected_aggregates(db), actual_aggregates(db)
    assert actual["projects"][tree["project"]] == expected["projects"][tree["project"]]
    assert actual["projects"][tree["project"]][0] == 60  # price_min


def test_an_edit_during_the_recalc_waits_for_it_and_is_never_aborted(db, pg_dsn):
    """Tried: a drain process claims the queue row and is slowed (test trigger) while writing the
    buildings; meanwhile an API-like transaction renames the project's layout group and edits an
    object's price (its raiser then needs the queue row the drain holds). The drain locked every
    row it may write right after the claim (lock_project), so the rename simply waits for the
    drain's commit: no lock cycle. (When the drain locked the group only on reaching it, this was
    a cycle: here the drain deferred, but had the buildings taken half a second longer, the edit's
    deadlock check would have come first and aborted the edit.) The drain recalculates, the edit
    commits and queues the project again, and the next tick takes the new price."""
    tree, free_object = _due_project_and_free_object(db)
    with slow_recalc(db, 0.3, table="buildings"):
        proc = start_pin(pg_dsn, "recalc", "drain", "--once")
        _wait_for(lambda: sleeping_backends(db) == 1, 15, "the drain writing the buildings")
        with psycopg.connect(pg_dsn) as api:
            api.execute(
                "UPDATE chessboard.layout_groups SET name = 'Студии, правка' WHERE id = %s",
                (tree["group"],),
            )
            api.execute(
                "UPDATE chessboard.property_objects SET price = 60 WHERE id = %s", (free_object,)
            )
            api.commit()
        summary, _, _ = _finish(proc)

    assert (summary["processed"], summary["deferred"], summary["failed"]) == (1, 0, 0)
    assert queue_row(db, tree["project"]) is not None  # queued again by the edit's raiser
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '1 second'")
    summary, _, _ = _finish(start_pin(pg_dsn, "recalc", "drain", "--once"))
    assert summary["processed"] == 1
    assert actual_aggregates(db)["projects"][tree["project"]][0] == 60  # price_min


def test_a_request_between_the_claim_and_the_work_is_served_and_counted(
    db: psycopg.Connection, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec 000: chessboard_recalc_coalesced_events_total is Σ RequestedCount of the requests
    the recalculations served. Tried: a due project; right after its claim commits (from the
    claim itself, over another session), an edit reprices its free object, and the edit's
    raiser bumps the claimed row's requested_count before the work locks the row again (the
    edit first asks for the queue table in EXCLUSIVE mode, granted before the work's lock; the
    work's lock wait raised to 10 × deadlock_timeout so a slow commit of the edit is waited for).
    The work then recomputes with the new price and deletes the row: the edit's request is
    served. The counter added the count read at claim time, one short (the code before:
    `assert 6 == 7`); now it adds the row's count under the work's lock, as does the tick's
    summary."""
    monkeypatch.setattr(drain, "LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT", 10.0)
    tree, free_object = _due_project_and_free_object(db)
    project = tree["project"]
    claimed_with = queue_row(db, project)["requested_count"]
    coalesced = counter(db, "coalesced_events")
    edit = (
        "BEGIN; LOCK TABLE chessboard.project_recalc_requests IN EXCLUSIVE MODE;"
        f" UPDATE chessboard.property_objects SET price = 60 WHERE id = '{free_object}'; COMMIT;"
    )
    with claim_hook(db, project, pg_dsn, edit):
        tick = drain_tick(pg_dsn)
    assert [(r.project_id, r.outcome) for r in tick.results] == [(project, "recalculated")]
    assert queue_row(db, project) is None  # the edit's request was served by this recompute
    assert actual_aggregates(db)["projects"][project][0] == 60  # price_min, the edit's
    assert counter(db, "coalesced_events") - coalesced == claimed_with + 1
    assert tick.as_dict()["coalesced_events"] == claimed_with + 1
