"""Spec 000, the drain: one tick over due rows, each project in its own transaction, aggregates
recomputed from the source rows, snapshot events in the outbox, failures, poison and skips."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.errors import PinError
from pin_pipelines.recalc import drain as drain_module
from pin_pipelines.recalc.drain import TickSummary, drain_tick, drain_until_idle
from pin_pipelines.recalc.enqueue import force_recalc, requeue_poisoned
from tests.support.chessboard import (
    make_all_due,
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.recalc import (
    clear_queue,
    drain_due,
    failing_recalc,
    last_json_line,
    outbox,
    queue_row,
    queued_projects,
    server_edit,
    set_settings,
    start_pin,
)
from tests.support.truth import actual_aggregates, drift, expected_aggregates, versions

ISO_MS_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
PROJECT_TOPIC = "pin.chessboard.project-upserted.v1"
LAYOUT_TOPIC = "pin.chessboard.layout-upserted.v1"
GROUP_TOPIC = "pin.chessboard.layout-group-upserted.v1"
#: log_event's `ts`: UTC, milliseconds.
LOG_TS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}\+00:00$")
#: The keys every per-project line of a tick starts with (spec 000, Logs: ProjectId; the claim's
#: TenantId and LastReason).
PROJECT_LINE_KEYS = {"ts", "event", "correlation_id", "project_id", "tenant_id", "last_reason"}
#: Per outcome of a claimed project: its line's event, level and the keys it adds. Written out
#: here, not read from drain.py, so that a line renamed, re-levelled or losing a field fails.
OUTCOME_LINES: dict[str, tuple[str, int, set[str]]] = {
    "recalculated": (
        "project_recalculated",
        logging.INFO,
        {"duration_seconds", "republished", "waited_seconds"},
    ),
    "skipped_archived": ("project_skipped_archived", logging.INFO, set()),
    "failed": ("project_recalc_failed", logging.WARNING, {"attempt_count", "error"}),
    "deferred": ("project_recalc_deferred", logging.INFO, {"reason"}),
}
#: The summary counts recalc_batch_finished carries (with its own duration_seconds).
FINISHED_COUNTS = (
    "processed",
    "failed",
    "skipped_archived",
    "deferred",
    "interrupted",
    "poisoned",
    "republished",
    "stopped_early",
)


def _row(conn: psycopg.Connection, table: str, row_id: UUID) -> dict:
    cur = conn.execute(f"SELECT * FROM chessboard.{table} WHERE id = %s", (row_id,))
    values = cur.fetchone()
    assert values is not None, f"{table} {row_id} missing"
    return dict(zip([d.name for d in cur.description or []], values, strict=True))


def _assert_envelope(payload: dict, row_id: UUID, version: int) -> None:
    assert payload["ContractVersion"] == 1
    assert UUID(payload["EventId"])
    assert ISO_MS_Z.match(payload["CreatedAt"]), payload["CreatedAt"]
    assert payload["Id"] == str(row_id)
    assert payload["Version"] == version


def _populated_project(conn: psycopg.Connection) -> dict[str, UUID]:
    """A project with one building, one group, one layout and three objects (two Free)."""
    project = make_project(conn)
    building = make_building(conn, project)
    group = make_layout_group(conn, project)
    layout = make_layout(conn, project, group, 30)
    make_object(conn, project, building, layout, status="Free", price=100)
    make_object(conn, project, building, layout, status="Free", price=300)
    make_object(conn, project, building, layout, status="Sold", price=200)
    return {"project": project, "building": building, "group": group, "layout": layout}


@dataclass(frozen=True)
class _Queue:
    """The queue rows before a tick, the database's clock then and this process's."""

    at: datetime
    taken: float  # time.monotonic()
    rows: dict[UUID, dict[str, Any]]


def _queue(conn: psycopg.Connection) -> _Queue:
    taken = time.monotonic()  # before the database's clock: no later than it
    at = conn.execute("SELECT now()").fetchone()[0]
    return _Queue(at, taken, queued_projects(conn))


@contextmanager
def _drain_log(caplog: pytest.LogCaptureFixture) -> Iterator[list[tuple[int, dict]]]:
    """Every pin_pipelines line logged in the block, as (level, JSON object), DEBUG included: the
    list is filled when the block ends."""
    lines: list[tuple[int, dict]] = []
    start = len(caplog.records)
    with caplog.at_level(logging.DEBUG, logger="pin_pipelines.recalc"):
        yield lines
    lines.extend(
        (r.levelno, json.loads(r.getMessage()))
        for r in caplog.records[start:]
        if r.name == "pin_pipelines" or r.name.startswith("pin_pipelines.")
    )


def _tick_lines(
    lines: list[tuple[int, dict]],
    tick: TickSummary,
    queue: _Queue,
    *,
    due: int,
    batch_size: int = 50,
) -> list[tuple[int, dict]]:
    """Asserts that `lines` start with exactly the lines of `tick`, whole (every key of every
    line, and its level), and returns the lines after them. `queue` is the queue before the tick:
    the claimed rows' tenant, reason, attempts and wait; `due` the rows due at its start."""
    n = 2 + len(tick.results) + len(tick.newly_poisoned)
    mine, rest = lines[:n], lines[n:]
    assert [line["event"] for _, line in mine] == [
        "recalc_batch_started",
        *(OUTCOME_LINES[r.outcome][0] for r in tick.results),
        "recalc_batch_finished",
        *(["CHESSBOARD_RECALC_POISON"] * len(tick.newly_poisoned)),
    ]
    for _, line in mine:
        assert line["correlation_id"] == tick.correlation_id, line
    stamps = [line["ts"] for _, line in mine]
    assert all(LOG_TS.match(ts) for ts in stamps), stamps
    assert stamps == sorted(stamps)

    (started_level, started), *projects, (finished_level, finished) = mine[: 2 + len(tick.results)]
    assert tick.due_at_start == due
    assert started == {
        "ts": started["ts"],
        "event": "recalc_batch_started",
        "correlation_id": tick.correlation_id,
        "size": min(due, batch_size),
        "due": due,
    }
    assert started_level == (logging.INFO if due else logging.DEBUG)

    finished_seconds = finished["duration_seconds"]
    for (level, line), result in zip(projects, tick.results, strict=True):
        _, expected_level, added = OUTCOME_LINES[result.outcome]
        row = queue.rows[result.project_id]
        assert level == expected_level, line
        assert line.keys() == PROJECT_LINE_KEYS | added, line
        assert (line["project_id"], line["tenant_id"], line["last_reason"]) == (
            str(result.project_id),
            str(row["tenant_id"]),
            row["last_reason"],
        )
        if result.outcome == "recalculated":
            assert line["duration_seconds"] == round(result.duration_seconds, 4)
            assert 0 < line["duration_seconds"] <= finished_seconds
            assert line["republished"] == result.republished
            assert set(line["republished"]) == {"layout", "layout_group", "project"}
            # From first_requested_at to the claim, which came after the snapshot (0.1 s).
            waited = (queue.at - row["first_requested_at"]).total_seconds()
            since = time.monotonic() - queue.taken
            assert waited - 0.05 <= line["waited_seconds"] <= waited + since + 0.05, line
        elif result.outcome == "failed":
            assert line["attempt_count"] == row["attempt_count"] + 1
            assert line["error"] == result.error
        elif result.outcome == "deferred":
            assert line["reason"] == "row lock held elsewhere"

    summary = tick.as_dict()
    assert finished == {
        "ts": finished["ts"],
        "event": "recalc_batch_finished",
        "correlation_id": tick.correlation_id,
        **{k: summary[k] for k in FINISHED_COUNTS},
        "duration_seconds": finished_seconds,
    }
    assert sum(r.duration_seconds for r in tick.results) <= finished_seconds + 1e-3
    assert 0 < finished_seconds < 30  # spec 000: a tick takes < 30 s
    assert finished_level == (logging.INFO if tick.results else started_level)
    failures = {r.project_id: r for r in tick.results if r.outcome == "failed"}
    for (level, poison), project in zip(
        mine[2 + len(tick.results) :], tick.newly_poisoned, strict=True
    ):
        assert level == logging.ERROR
        assert poison == {
            "ts": poison["ts"],
            "event": "CHESSBOARD_RECALC_POISON",
            "correlation_id": tick.correlation_id,
            "project_id": str(project),
            "attempt_count": failures[project].attempt_count,
            "error": failures[project].error,
            "poisoned": tick.poisoned,
        }
    return rest


def test_empty_batch_is_a_noop_success(db, pg_dsn, caplog):
    """A tick over an empty queue, then over a queue whose only row is due in 30 s (in process
    and as `pin recalc drain --once`): nothing processed, nothing failed, the row untouched,
    exit code 0 with the JSON summary on the last stdout line. Each in-process tick logs just
    recalc_batch_started (size 0, due 0) and recalc_batch_finished, both at DEBUG."""
    with _drain_log(caplog) as lines:
        empty = drain_tick(pg_dsn)
    assert _tick_lines(lines, empty, _queue(db), due=0) == []
    summary = empty.as_dict()
    assert {k: summary[k] for k in ("processed", "failed", "skipped_archived", "poisoned")} == {
        "processed": 0,
        "failed": 0,
        "skipped_archived": 0,
        "poisoned": 0,
    }
    project = make_project(db)
    make_building(db, project)  # queued by the raiser, due after the default 30 s debounce
    before = queue_row(db, project)
    with _drain_log(caplog) as lines:
        not_due = drain_tick(pg_dsn)
    assert not_due.results == []
    assert _tick_lines(lines, not_due, _queue(db), due=0) == []

    proc = start_pin(pg_dsn, "recalc", "drain", "--once")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    cli = last_json_line(stdout)
    assert (cli["processed"], cli["failed"], cli["skipped_archived"], cli["poisoned"]) == (
        0,
        0,
        0,
        0,
    )
    assert queue_row(db, project) == before
    assert outbox(db) == []
    assert _row(db, "projects", project)["version"] == 1


def test_project_without_free_objects_has_null_prices_and_publishes_its_event(db, pg_dsn):
    """Objects Booked, Sold, Reserved, Hidden and a soft-deleted Free one: price_min/max NULL,
    free 0, total 3 (Hidden and soft-deleted excluded), version 2, and one project event in
    the outbox with the contract payload (envelope, TenantId, Name, Status, null prices)."""
    project = make_project(db, status="Hidden")
    building = make_building(db, project)
    make_object(db, project, building, None, status="Booked", price=10)
    make_object(db, project, building, None, status="Sold", price=20)
    make_object(db, project, building, None, status="Reserved", price=30)
    make_object(db, project, building, None, status="Hidden", price=40)
    deleted = make_object(db, project, building, None, status="Free", price=50)
    db.execute(
        "UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %s", (deleted,)
    )

    tick = drain_due(pg_dsn, db)
    assert (tick.processed, tick.as_dict()["republished"]["project"]) == (1, 1)
    row = _row(db, "projects", project)
    assert (row["price_min"], row["price_max"]) == (None, None)
    assert (row["property_objects_free_count"], row["property_objects_total_count"]) == (0, 3)
    assert row["version"] == 2

    events = outbox(db, project)
    assert len(events) == 1
    topic, key, payload = events[0]
    assert (topic, key) == (PROJECT_TOPIC, str(project))
    _assert_envelope(payload, project, 2)
    assert payload["TenantId"] == str(row["tenant_id"])
    assert payload["Name"] == row["name"]
    assert payload["Status"] == "Hidden"
    assert payload["PriceMin"] is None and payload["PriceMax"] is None
    assert "PriceMin" in payload and "PriceMax" in payload
    assert payload["PropertyObjectsTotalCount"] == 3
    assert payload["PropertyObjectsFreeCount"] == 0


def test_project_prices_are_free_object_bounds_as_json_numbers(db, pg_dsn):
    """Free objects at 1500.50 and 990, a Booked one at 10 and a Free Hidden-excluded set: the
    project's bounds are min/max over Free objects only, published as JSON numbers."""
    project = make_project(db)
    building = make_building(db, project)
    make_object(db, project, building, None, status="Free", price=Decimal("1500.50"))
    make_object(db, project, building, None, status="Free", price=990)
    make_object(db, project, building, None, status="Booked", price=10)
    make_object(db, project, building, None, status="Hidden", price=5)
    drain_due(pg_dsn, db)
    row = _row(db, "projects", project)
    assert (row["price_min"], row["price_max"]) == (Decimal(990), Decimal("1500.50"))
    assert (row["property_objects_total_count"], row["property_objects_free_count"]) == (3, 2)
    ((_, _, payload),) = outbox(db, project)
    assert (payload["PriceMin"], payload["PriceMax"]) == (990, 1500.5)
    assert isinstance(payload["PriceMax"], float | int)


def test_project_without_objects_or_layouts_gets_zero_counters_and_null_bounds(db, pg_dsn):
    """A project with a building and an empty layout group but no objects and no layouts, whose
    aggregate columns hold stale values (5 objects, prices 1..2, group 2 layouts of 10..20 m²):
    a recalc sets every counter to 0 and every price/area bound to NULL."""
    project = make_project(db)
    building = make_building(db, project)
    group = make_layout_group(db, project)
    db.execute(
        "UPDATE chessboard.projects SET property_objects_total_count = 5,"
        " property_objects_free_count = 4, price_min = 1, price_max = 2 WHERE id = %s",
        (project,),
    )
    db.execute(
        "UPDATE chessboard.buildings SET property_objects_total_count = 5,"
        " property_objects_free_count = 4 WHERE id = %s",
        (building,),
    )
    db.execute(
        "UPDATE chessboard.layout_groups SET layouts_count = 2, area_min = 10, area_max = 20"
        " WHERE id = %s",
        (group,),
    )
    force_recalc(pg_dsn, project)
    assert drain_tick(pg_dsn).processed == 1
    p = _row(db, "projects", project)
    assert (p["property_objects_total_count"], p["property_objects_free_count"]) == (0, 0)
    assert (p["price_min"], p["price_max"]) == (None, None)
    b = _row(db, "buildings", building)
    assert (b["property_objects_total_count"], b["property_objects_free_count"]) == (0, 0)
    g = _row(db, "layout_groups", group)
    assert (g["layouts_count"], g["area_min"], g["area_max"]) == (0, None, None)
    ((_, _, group_event),) = [e for e in outbox(db) if e[0] == GROUP_TOPIC]
    assert (group_event["LayoutsCount"], group_event["AreaMin"], group_event["AreaMax"]) == (
        0,
        None,
        None,
    )


def test_duplicate_run_gives_identical_values_without_new_version_or_events(db, pg_dsn):
    """A populated project drained, then force-recalculated and drained again with no source
    change: processed again, but every aggregate and version identical and no new event."""
    tree = _populated_project(db)
    assert drain_due(pg_dsn, db).processed == 1
    aggregates, before_versions, events = actual_aggregates(db), versions(db), outbox(db)
    assert len(events) == 3  # project, layout, layout group

    force_recalc(pg_dsn, tree["project"])
    tick = drain_tick(pg_dsn)
    assert tick.processed == 1
    assert tick.results[0].republished == {"layout": 0, "layout_group": 0, "project": 0}
    assert tick.results[0].buildings_updated == 0
    assert actual_aggregates(db) == aggregates
    assert versions(db) == before_versions
    assert outbox(db) == events
    assert queued_projects(db) == {}


def test_building_counters_are_updated_without_a_building_event(db, pg_dsn):
    """Two buildings (3 objects: Free, Booked, Hidden; and 1 Free soft-deleted + 1 Free): each
    building's total/free counters are recomputed and its version bumped, and no event of any
    topic is keyed by a building id nor has a building topic."""
    project = make_project(db)
    b1, b2 = make_building(db, project), make_building(db, project)
    make_object(db, project, b1, None, status="Free", price=1)
    make_object(db, project, b1, None, status="Booked", price=1)
    make_object(db, project, b1, None, status="Hidden", price=1)
    gone = make_object(db, project, b2, None, status="Free", price=1)
    make_object(db, project, b2, None, status="Free", price=1)
    db.execute("UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %s", (gone,))

    tick = drain_due(pg_dsn, db)
    assert tick.results[0].buildings_updated == 2
    r1, r2 = _row(db, "buildings", b1), _row(db, "buildings", b2)
    assert (r1["property_objects_total_count"], r1["property_objects_free_count"]) == (2, 1)
    assert (r2["property_objects_total_count"], r2["property_objects_free_count"]) == (1, 1)
    assert (r1["version"], r2["version"]) == (2, 2)
    events = outbox(db)
    assert {topic for topic, _, _ in events} == {PROJECT_TOPIC}
    assert not [e for e in events if e[1] in {str(b1), str(b2)}]
    assert not [t for t, _, _ in events if "building" in t]


def test_layout_counts_and_group_bounds_are_recomputed_with_events(db, pg_dsn):
    """Layouts of 30, 50 and 70 m² (the 70 one soft-deleted) in one group and a layout without
    objects: each layout counts its active objects (Hidden/soft-deleted excluded); the group
    counts live layouts and bounds their area; every row is published once with the contract's
    payloads and the new versions (none was published before: the contract publishes a row
    whose snapshot differs from the last one published). Then one object is sold: only its
    layout and the project publish again."""
    project = make_project(db)
    building = make_building(db, project)
    group = make_layout_group(db, project, name="Двушки")
    l30 = make_layout(db, project, group, 30)
    l50 = make_layout(db, project, group, 50)
    l70 = make_layout(db, project, group, 70)
    empty = make_layout(db, project, None, 99)
    for status in ("Free", "Sold", "Hidden"):
        make_object(db, project, building, l30, status=status)
    gone = make_object(db, project, building, l50, status="Booked")
    make_object(db, project, building, l50, status="Free")
    db.execute("UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %s", (gone,))
    db.execute("UPDATE chessboard.layouts SET deleted_at = now() WHERE id = %s", (l70,))

    tick = drain_due(pg_dsn, db)
    assert tick.results[0].republished == {"layout": 4, "layout_group": 1, "project": 1}
    assert _row(db, "layouts", l30)["property_objects_count"] == 2
    assert _row(db, "layouts", l50)["property_objects_count"] == 1
    assert _row(db, "layouts", l70)["property_objects_count"] == 0
    assert _row(db, "layouts", empty)["version"] == 2  # counts unchanged, published once
    g = _row(db, "layout_groups", group)
    assert (g["layouts_count"], g["area_min"], g["area_max"]) == (2, Decimal(30), Decimal(50))
    assert g["version"] == 2

    events = outbox(db)
    layout_events = {key: payload for topic, key, payload in events if topic == LAYOUT_TOPIC}
    assert set(layout_events) == {str(l30), str(l50), str(l70), str(empty)}
    assert layout_events[str(empty)]["PropertyObjectsCount"] == 0
    assert layout_events[str(l70)]["IsDeleted"] is True
    payload = layout_events[str(l30)]
    _assert_envelope(payload, l30, 2)
    assert payload["ProjectId"] == str(project)
    assert payload["LayoutGroupId"] == str(group)
    assert payload["TotalArea"] == 30
    assert payload["PropertyObjectsCount"] == 2

    ((_, key, gp),) = [e for e in events if e[0] == GROUP_TOPIC]
    assert key == str(group)
    _assert_envelope(gp, group, 2)
    assert gp["ProjectId"] == str(project)
    assert gp["TenantId"] == str(g["tenant_id"])
    assert (gp["Name"], gp["SortOrder"], gp["IsArchived"]) == ("Двушки", 0, False)
    assert (gp["LayoutsCount"], gp["AreaMin"], gp["AreaMax"]) == (2, 30, 50)
    assert drift(db) == {}

    db.execute("TRUNCATE chessboard.outbox_events")
    db.execute(
        "UPDATE chessboard.property_objects SET status = 'Sold'"
        " WHERE layout_id = %s AND status = 'Free'",
        (l30,),
    )
    tick = drain_due(pg_dsn, db)
    assert tick.results[0].republished == {"layout": 0, "layout_group": 0, "project": 1}
    assert {(t, k) for t, k, _ in outbox(db)} == {(PROJECT_TOPIC, str(project))}
    assert _row(db, "layouts", l30)["version"] == 2  # still 2 active objects: unchanged


def test_partial_failure_rolls_back_only_that_project(db, pg_dsn, caplog):
    """Three due projects; the first one's recalc raises for real (a test-only trigger with a
    3000-character message): its whole transaction is rolled back (no building, layout, group
    or project change, no event), its row stays with due_at unchanged, attempt_count 1 and
    last_error truncated to 1024 characters; the other two are recalculated in the same tick.
    Its log: project_recalc_failed at WARNING (attempt_count 1, the stored error), then a
    project_recalculated line per other project, between the batch's started (size 3) and
    finished (processed 2, failed 1) lines."""
    failing = _populated_project(db)
    others = [_populated_project(db) for _ in range(2)]
    make_all_due(db)
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = due_at - interval '1 minute'"
        " WHERE project_id = %s",
        (failing["project"],),
    )  # first in due_at order
    due_before = queue_row(db, failing["project"])["due_at"]
    before = versions(db)
    queue = _queue(db)

    with failing_recalc(db, failing["project"], "boom " + "x" * 3000), _drain_log(caplog) as lines:
        tick = drain_tick(pg_dsn)
    assert (tick.processed, tick.count("failed")) == (2, 1)
    assert _tick_lines(lines, tick, queue, due=3) == []
    failed_line = lines[1][1]
    assert failed_line["attempt_count"] == 1
    assert failed_line["error"] == queue_row(db, failing["project"])["last_error"]
    assert failed_line["error"].startswith("RaiseException: boom xxx")
    assert tick.results[0].project_id == failing["project"]
    assert tick.results[0].outcome == "failed"

    row = queue_row(db, failing["project"])
    assert row["due_at"] == due_before
    assert row["attempt_count"] == 1
    assert len(row["last_error"]) == 1024
    assert "boom xxx" in row["last_error"]
    after = versions(db)
    for table, key in (
        ("projects", "project"),
        ("buildings", "building"),
        ("layouts", "layout"),
        ("layout_groups", "group"),
    ):
        assert after[table][failing[key]] == before[table][failing[key]] == 1, table
    assert _row(db, "buildings", failing["building"])["property_objects_total_count"] == 0
    assert not [e for e in outbox(db) if e[1] in {str(v) for v in failing.values()}]

    assert set(queued_projects(db)) == {failing["project"]}
    for other in others:
        assert _row(db, "projects", other["project"])["property_objects_total_count"] == 3
        assert outbox(db, other["project"])


def test_failed_row_is_retried_not_before_retry_interval(db, pg_dsn, caplog):
    """retry_interval 1 s, a project whose recalc fails: an immediate second tick leaves the
    row alone (attempt_count stays 1); a tick after 1 s retries it (attempt 2); once the
    cause is gone the next retry recalculates it and deletes the row."""
    set_settings(db, retry_interval="1 second")
    tree = _populated_project(db)
    with failing_recalc(db, tree["project"], "transient"):
        assert drain_due(pg_dsn, db).count("failed") == 1
        with _drain_log(caplog) as lines:
            tick = drain_tick(pg_dsn)
        assert tick.results == []
        # Due but waiting for its retry: counted in due and size, and logged at INFO.
        assert _tick_lines(lines, tick, _queue(db), due=1) == []
        assert queue_row(db, tree["project"])["attempt_count"] == 1
        time.sleep(1.05)
        assert drain_tick(pg_dsn).count("failed") == 1
        assert queue_row(db, tree["project"])["attempt_count"] == 2
    assert drain_tick(pg_dsn).results == []
    time.sleep(1.05)
    assert drain_tick(pg_dsn).processed == 1
    assert queue_row(db, tree["project"]) is None
    assert drift(db) == {}


def test_project_locked_by_an_api_edit_is_deferred_once_per_tick(db, pg_dsn, monkeypatch, caplog):
    """An HTTP-like edit holds the project row lock (lock_timeout lowered to 200 ms): the tick
    defers that project once (no attempt counted, row kept), goes on with the next project, and
    does not spin on the locked one for the rest of its batch; the next tick recalculates it.
    The deferral is logged as project_recalc_deferred (its reason), the tick's finished line
    counts it (deferred 1)."""
    # A fifth of deadlock_timeout: 200 ms with the default of 1 s.
    monkeypatch.setattr(drain_module, "LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT", 0.2)
    locked = _populated_project(db)
    other = _populated_project(db)
    make_all_due(db)
    queue = _queue(db)
    with psycopg.connect(pg_dsn) as api, api.transaction(), _drain_log(caplog) as lines:
        api.execute(
            "SELECT 1 FROM chessboard.projects WHERE id = %s FOR UPDATE", (locked["project"],)
        )
        started = time.monotonic()
        tick = drain_tick(pg_dsn)
        elapsed = time.monotonic() - started
    assert _tick_lines(lines, tick, queue, due=2) == []
    assert lines[-1][1]["deferred"] == 1
    outcomes = {r.project_id: r.outcome for r in tick.results}
    assert outcomes == {locked["project"]: "deferred", other["project"]: "recalculated"}
    assert len(tick.results) == 2
    assert elapsed < 2.0
    row = queue_row(db, locked["project"])
    assert (row["attempt_count"], row["last_error"]) == (0, None)
    assert drain_tick(pg_dsn).processed == 1
    assert drift(db) == {}


def test_row_failing_five_times_is_poisoned_and_requeue_resets_it(db, pg_dsn, caplog):
    """retry_interval 0 and a project failing every time: after 5 failed ticks the row is
    poison: further ticks do not claim it (attempt_count stays 5) while another due project
    is still processed, the tick and `pin recalc drain --once` report poisoned 1;
    requeue_poisoned resets attempt_count/last_error, makes it due now, and it then drains.
    Each failure logs its attempt_count (1 to 5); the fifth tick adds CHESSBOARD_RECALC_POISON
    (the project, its failed runs and error, poisoned 1) at ERROR, once: the ticks after it
    (in process, and `pin recalc drain --once`) report poisoned 1 but log no poison line again
    (the alert keeps firing on the gauge). Tried: the line logged on every tick with a poisoned
    row again (as before): the later ticks' lines fail this test."""
    set_settings(db, retry_interval="0 seconds")
    tree = _populated_project(db)
    make_all_due(db)
    with failing_recalc(db, tree["project"], "bad data"):
        for attempt in range(1, 6):
            queue = _queue(db)
            with _drain_log(caplog) as lines:
                tick = drain_tick(pg_dsn)
            assert tick.count("failed") == 1
            assert _tick_lines(lines, tick, queue, due=1) == []
            assert lines[1][1]["attempt_count"] == attempt
            assert [line["event"] for _, line in lines][-1] == (
                "CHESSBOARD_RECALC_POISON" if attempt == 5 else "recalc_batch_finished"
            )
            assert queue_row(db, tree["project"])["attempt_count"] == attempt
        assert tick.poisoned == 1

        assert tick.newly_poisoned == [tree["project"]]

        other = _populated_project(db)
        make_all_due(db)
        queue = _queue(db)
        with _drain_log(caplog) as lines:
            tick = drain_tick(pg_dsn)
        assert _tick_lines(lines, tick, queue, due=1) == []  # no poison line
        assert tick.newly_poisoned == []
        assert [r.project_id for r in tick.results] == [other["project"]]
        assert tick.processed == 1
        assert tick.poisoned == 1
        assert queue_row(db, tree["project"])["attempt_count"] == 5

        proc = start_pin(pg_dsn, "recalc", "drain", "--once")
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        summary = last_json_line(stdout)
        assert (summary["processed"], summary["failed"], summary["poisoned"]) == (0, 0, 1)
        assert "CHESSBOARD_RECALC_POISON" not in stderr

    row = queue_row(db, tree["project"])
    assert row["attempt_count"] == 5 and "bad data" in row["last_error"]
    requeue_poisoned(pg_dsn, tree["project"])
    row = queue_row(db, tree["project"])
    assert (row["attempt_count"], row["last_error"]) == (0, None)
    assert row["due_at"] <= db.execute("SELECT now()").fetchone()[0]
    tick = drain_tick(pg_dsn)
    assert (tick.processed, tick.poisoned) == (1, 0)
    assert queued_projects(db) == {}
    assert drift(db) == {}


@pytest.mark.parametrize("state", ["archived", "soft-deleted", "hard-deleted"])
def test_archived_or_deleted_project_row_is_deleted_without_events(db, pg_dsn, state, caplog):
    """A queued project that is Archived, soft-deleted or gone altogether: the tick deletes its
    row and counts it in skipped_archived, writes no event and leaves the aggregates as they
    were (0 counters, version 1), while a live project in the same tick is recalculated. The
    skipped project's line is project_skipped_archived with the claim's fields only."""
    tree = _populated_project(db)
    live = _populated_project(db)
    if state == "archived":
        db.execute(
            "UPDATE chessboard.projects SET status = 'Archived' WHERE id = %s", (tree["project"],)
        )
    elif state == "soft-deleted":
        db.execute(
            "UPDATE chessboard.projects SET deleted_at = now() WHERE id = %s", (tree["project"],)
        )
    else:
        tenant = _row(db, "projects", tree["project"])["tenant_id"]
        db.execute("DELETE FROM chessboard.projects WHERE id = %s", (tree["project"],))
        db.execute(
            "SELECT chessboard.request_project_recalc(%s, %s, 'Crud')", (tree["project"], tenant)
        )
    assert tree["project"] in queued_projects(db)
    before = versions(db)
    make_all_due(db)
    queue = _queue(db)

    with _drain_log(caplog) as lines:
        tick = drain_tick(pg_dsn)
    assert _tick_lines(lines, tick, queue, due=2) == []
    assert "project_skipped_archived" in [line["event"] for _, line in lines]
    summary = tick.as_dict()
    assert (summary["skipped_archived"], summary["processed"], summary["failed"]) == (1, 1, 0)
    assert queued_projects(db) == {}
    assert not [e for e in outbox(db) if e[1] in {str(v) for v in tree.values()}]
    assert outbox(db, live["project"])
    if state != "hard-deleted":
        after = versions(db)
        for table, key in (("projects", "project"), ("buildings", "building")):
            assert after[table][tree[key]] == before[table][tree[key]] == 1
        assert _row(db, "projects", tree["project"])["property_objects_total_count"] == 0


def test_request_arriving_during_a_recalc_is_not_lost(db, pg_dsn):
    """Spec 000: a request that arrives during the recalc inserts a new row. Tried with the
    real drain (drain_tick): inside the project's work transaction, as it writes the project's
    recomputed aggregates (before it deletes the queue row and commits), a test trigger sends
    an API edit from another session (dblink): the object's price changed in a transaction
    whose raiser then waits for the queue row the drain holds. Once the drain commits (the row
    deleted), the raiser inserts a fresh row (requested_count 1, first_requested_at after the
    tick started, the edit's reason); the next tick recalculates the new price and nothing is
    left stale. Broken on purpose (migration 0016's lock_claimed_request without FOR UPDATE:
    the claimed row not held through the work): the edit's upsert went through at once and
    the drain's delete then took it away, so this test failed with "lost"."""
    project = make_project(db)
    building = make_building(db, project)
    layout = make_layout(db, project, None, 40)
    obj = make_object(db, project, building, layout, status="Free", price=100)
    make_all_due(db)
    started = db.execute("SELECT clock_timestamp()").fetchone()[0]
    edit = f"UPDATE chessboard.property_objects SET price = 250 WHERE id = '{obj}'"
    with server_edit(db, pg_dsn, edit, on="UPDATE", when=f"NEW.id = '{project}'", table="projects"):
        tick = drain_tick(pg_dsn)
    assert [(r.project_id, r.outcome) for r in tick.results] == [(project, "recalculated")]
    assert _row(db, "projects", project)["price_max"] == 100  # what the drain had read
    row = queue_row(db, project)
    assert row is not None, "the request that arrived during the recalc was lost"
    assert row["requested_count"] == 1
    assert row["first_requested_at"] > started
    assert row["last_reason"] == "PropertyObjectPriceChanged"
    make_all_due(db)
    assert drain_tick(pg_dsn).processed == 1
    assert _row(db, "projects", project)["price_max"] == 250
    assert drift(db) == {}


def test_tick_takes_due_rows_oldest_first_up_to_the_batch_size(db, pg_dsn, caplog):
    """Four due projects with distinct due_at and batch_size 3 in recalc_settings: one tick
    processes the three oldest in due_at order and leaves the newest queued; its
    recalc_batch_started says size 3 (the batch size), due 4."""
    set_settings(db, batch_size=3)
    projects = [make_project(db) for _ in range(4)]
    for p in projects:
        make_building(db, p)
    clear_queue(db)
    for age, p in zip((40, 30, 20, 10), projects, strict=True):
        tenant = _row(db, "projects", p)["tenant_id"]
        db.execute(
            "INSERT INTO chessboard.project_recalc_requests (project_id, tenant_id, due_at,"
            " first_requested_at, last_reason) VALUES (%s, %s, now() - make_interval(secs => %s),"
            " now(), 'Crud')",
            (p, tenant, age),
        )
    queue = _queue(db)
    with _drain_log(caplog) as lines:
        tick = drain_tick(pg_dsn)
    assert _tick_lines(lines, tick, queue, due=4, batch_size=3) == []
    assert lines[0][1]["size"] == 3
    assert [r.project_id for r in tick.results] == projects[:3]
    assert set(queued_projects(db)) == {projects[3]}


def test_recalculated_values_equal_the_source_truth(db, pg_dsn):
    """Two populated projects and a third with only Hidden objects: after draining, every
    project/building/layout/group aggregate equals count/min/max computed in Python."""
    _populated_project(db)
    _populated_project(db)
    project = make_project(db)
    building = make_building(db, project)
    make_object(db, project, building, None, status="Hidden", price=uuid.uuid4().int % 1000)
    assert drift(db) != {}
    drain_due(pg_dsn, db)
    assert actual_aggregates(db) == expected_aggregates(db)


def test_every_log_line_of_a_tick_carries_its_correlation_id(db, pg_dsn, caplog):
    """Structured logs: every line of a tick (started, per project with ProjectId/TenantId/
    LastReason, finished with counts) is a JSON object carrying the tick's correlation id, the
    one its TickSummary reports: the caller's, a fresh one per tick without it, and tick n of
    drain_until_idle with a prefix carries `<prefix>.<n>`. project_recalculated has the spec's
    duration and republished counts (a project event, no layout or group) and the row's wait."""
    project = make_project(db)
    building = make_building(db, project)
    make_object(db, project, building, None)
    make_all_due(db)
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET first_requested_at = now() - interval"
        " '90 seconds'"
    )
    queue = _queue(db)
    with _drain_log(caplog) as lines:
        tick = drain_tick(pg_dsn, correlation_id="run-42.1")
    assert tick.correlation_id == "run-42.1"
    assert _tick_lines(lines, tick, queue, due=1) == []
    per_project = lines[1][1]
    assert per_project["project_id"] == str(project)
    assert per_project["tenant_id"] == str(_row(db, "projects", project)["tenant_id"])
    assert per_project["last_reason"] == queue.rows[project]["last_reason"]
    assert per_project["republished"] == {"layout": 0, "layout_group": 0, "project": 1}
    assert 90 <= per_project["waited_seconds"] < 95
    assert lines[-1][1]["processed"] == 1

    # Without an id: a fresh one per tick, on every line of that tick.
    with _drain_log(caplog) as lines:
        fresh = [drain_tick(pg_dsn), drain_tick(pg_dsn)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t.correlation_id) for t in fresh)
    assert fresh[0].correlation_id != fresh[1].correlation_id
    rest = _tick_lines(lines, fresh[0], _queue(db), due=0)
    assert _tick_lines(rest, fresh[1], _queue(db), due=0) == []

    # A run of ticks with a prefix: tick 1 recalculates, tick 2 finds nothing and ends the run.
    make_object(db, project, building, None)
    make_all_due(db)
    queue = _queue(db)
    with _drain_log(caplog) as lines:
        run = drain_until_idle(pg_dsn, budget_seconds=10, correlation_prefix="run-43")
    assert [t.correlation_id for t in run.ticks] == ["run-43.1", "run-43.2"]
    assert [t.processed for t in run.ticks] == [1, 0]
    rest = _tick_lines(lines, run.ticks[0], queue, due=1)
    assert _tick_lines(rest, run.ticks[1], _queue(db), due=0) == []


@contextmanager
def _run_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The backend pid of every connection the drain opens while inside."""
    opened, pids = drain_module.connection, []

    @contextmanager
    def spied(dsn: str, **kwargs: Any) -> Iterator[psycopg.Connection]:
        with opened(dsn, **kwargs) as conn:
            pids.append(conn.info.backend_pid)
            yield conn

    with monkeypatch.context() as patch:
        patch.setattr(drain_module, "connection", spied)
        yield pids


def test_a_drain_run_ticks_on_one_connection(db, pg_dsn, monkeypatch):
    """A run's ticks, and its waits for a row about to fall due, share one backend: a new one
    costs the server ~10 ms of CPU before its first project. Tried: three projects at a batch
    of one, the third falling due while the run waits: four ticks, one connection."""
    set_settings(db, batch_size=1)
    projects = [make_project(db) for _ in range(3)]
    for project in projects:
        make_object(db, project, make_building(db, project), None)
    make_all_due(db)
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = now() + interval '1.5 seconds'"
        " WHERE project_id = %s",
        (projects[2],),
    )
    with _run_backends(monkeypatch) as pids:
        run = drain_until_idle(pg_dsn, budget_seconds=20)
    assert [t.processed for t in run.ticks if t.processed] == [1, 1, 1]
    assert len(pids) == 1
    assert queued_projects(db) == {}


def test_a_run_that_loses_its_connection_between_ticks_ends_in_one_line_and_loses_nothing(
    db, pg_dsn, monkeypatch
):
    """Tried: the run's backend terminated (as a server restart or an operator's
    pg_terminate_backend would) while the run waits for a row about to fall due. The run ends
    with one line naming the server; the waiting row is still queued, unclaimed and with no
    attempt counted, and the next drain recalculates it."""
    done, waiting = make_project(db), make_project(db)
    for project in (done, waiting):
        make_object(db, project, make_building(db, project), None)
    make_all_due(db)
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = now() + interval '3 seconds'"
        " WHERE project_id = %s",
        (waiting,),
    )

    def terminate_once_the_first_is_done(pids: list[int]) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            deadline = time.monotonic() + 10
            while queue_row(watcher, done) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            watcher.execute("SELECT pg_terminate_backend(%s)", (pids[0],))

    with _run_backends(monkeypatch) as pids:
        started = time.monotonic()
        killer = threading.Timer(0.2, terminate_once_the_first_is_done, args=(pids,))
        killer.start()
        try:
            with pytest.raises(PinError) as raised:
                drain_until_idle(pg_dsn, budget_seconds=20)
        finally:
            killer.join()
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "\n" not in message and "connection lost" in message, message
    assert queue_row(db, done) is None
    row = queue_row(db, waiting)
    assert row is not None
    assert (row["claimed_at"], row["attempt_count"]) == (None, 0)
    make_all_due(db)
    assert drain_tick(pg_dsn).processed == 1


def _step_commit_setting(pg_dsn: str, project: UUID) -> tuple[str, str, int]:
    """The project claimed and stepped (chessboard.recalc_project_step) in a transaction left
    open: its outcome, the synchronous_commit its COMMIT would use, and the events it wrote."""
    with psycopg.connect(pg_dsn) as conn:
        claim = conn.execute(
            "SELECT project_id, claimed_at, previous_attempted_at, requested_count"
            " FROM chessboard.claim_due_request(NULL)"
        ).fetchone()
        assert claim is not None and claim[0] == project
        step = conn.execute(
            "SELECT outcome, layouts_published + layout_groups_published + projects_published"
            " FROM chessboard.recalc_project_step(%s, %s, %s, %s, NULL, 0.5, false, NULL)",
            claim,
        ).fetchone()
        setting = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        conn.rollback()
    assert step is not None and setting is not None
    return step[0], setting[0], step[1]


def test_a_recompute_that_publishes_nothing_does_not_wait_for_the_wal_flush(
    db: psycopg.Connection, pg_dsn: str
) -> None:
    """Tried: a project drained once, then due again twice: with nothing changed, and with an
    object's status changed; each time claimed and stepped in a transaction left open to read
    the setting its COMMIT would use. Nothing to publish: synchronous_commit off (migration
    0016: a server crash could only forget a recompute that told no one). Events written: on,
    so a crash cannot take back events the relay may already have sent."""
    project = make_project(db)
    building = make_building(db, project)
    item = make_object(db, project, building, None)
    drain_due(pg_dsn, db)

    force_recalc(pg_dsn, project)
    assert _step_commit_setting(pg_dsn, project) == ("recalculated", "off", 0)

    db.execute("UPDATE chessboard.property_objects SET status = 'Sold' WHERE id = %s", (item,))
    make_all_due(db)
    outcome, setting, events = _step_commit_setting(pg_dsn, project)
    assert (outcome, setting) == ("recalculated", "on") and events >= 1
