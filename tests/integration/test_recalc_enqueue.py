"""Spec 000, the enqueue side: the trailing debounce upsert, its thresholds, coalescing, the
starvation cap and the raisers (triggers) on property_objects, layouts and buildings."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from decimal import Decimal
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.config import DEFAULT_RECALC_TICK_SECONDS, dsn_with_dbname, recalc_tick_seconds
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.recalc.enqueue import RecalcReason, force_recalc
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.cli import assert_one_line_error, run_pin
from tests.support.database import BASE_TEST_PG_DSN
from tests.support.recalc import (
    clear_queue,
    drain_all,
    drain_due,
    queue_row,
    queued_projects,
    set_settings,
)
from tests.support.truth import actual_aggregates, drift
from tests.support.workers import run_lock

SECOND = timedelta(seconds=1)


def _request(conn: psycopg.Connection, project_id: UUID, tenant_id: UUID, reason: str):
    """One explicit raiser call; returns the transaction's now() (the function's clock)."""
    with conn.transaction():
        now = conn.execute("SELECT now()").fetchone()[0]
        conn.execute(
            "SELECT chessboard.request_project_recalc(%s, %s, %s)", (project_id, tenant_id, reason)
        )
    return now


def _tenant(conn: psycopg.Connection, project_id: UUID) -> UUID:
    return conn.execute(
        "SELECT tenant_id FROM chessboard.projects WHERE id = %s", (project_id,)
    ).fetchone()[0]


def _clock(conn: psycopg.Connection):
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def _project_with_tree(conn: psycopg.Connection) -> dict[str, UUID]:
    project = make_project(conn)
    building = make_building(conn, project)
    group = make_layout_group(conn, project)
    layout = make_layout(conn, project, group, 40)
    obj = make_object(conn, project, building, layout, status="Free", price=1000)
    return {"project": project, "building": building, "group": group, "layout": layout, "obj": obj}


def test_new_request_is_due_after_debounce_with_first_requested_at_now(db):
    """request_project_recalc on a project without a row (debounce 1 s): the new row has
    due_at = now + 1 s, first_requested_at = now, requested_count 1, the reason and tenant."""
    set_settings(db, debounce="1 second", starvation_cap="5 seconds")
    project, tenant = uuid.uuid4(), uuid.uuid4()
    now = _request(db, project, tenant, "TalentSync")
    row = queue_row(db, project)
    assert row is not None
    assert row["due_at"] == now + SECOND
    assert row["first_requested_at"] == now
    assert row["requested_count"] == 1
    assert row["last_reason"] == "TalentSync"
    assert row["tenant_id"] == tenant
    assert row["attempt_count"] == 0
    assert row["last_error"] is None


def test_repeated_request_pushes_due_at_by_debounce_and_counts(db):
    """Two more requests for a queued project (debounce 1 s, cap 5 s, well inside the cap):
    due_at = now + 1 s of the latest request, first_requested_at kept, requested_count += 1
    each time, last_reason = the latest reason."""
    set_settings(db, debounce="1 second", starvation_cap="5 seconds")
    project, tenant = uuid.uuid4(), uuid.uuid4()
    first = _request(db, project, tenant, "Crud")
    second = _request(db, project, tenant, "PropertyObjectPriceChanged")
    row = queue_row(db, project)
    assert row["due_at"] == second + SECOND
    assert row["first_requested_at"] == first
    assert row["requested_count"] == 2
    assert row["last_reason"] == "PropertyObjectPriceChanged"
    third = _request(db, project, tenant, "LayoutChanged")
    row = queue_row(db, project)
    assert row["due_at"] == third + SECOND
    assert row["first_requested_at"] == first
    assert row["requested_count"] == 3
    assert row["last_reason"] == "LayoutChanged"


def test_repeated_request_never_pushes_due_at_past_the_starvation_cap(db):
    """A request 4.5 s after the first one (debounce 1 s, cap 5 s; the row's first_requested_at
    is moved back 4.5 s): due_at = least(now + 1 s, first + 5 s) = first + 5 s."""
    set_settings(db, debounce="1 second", starvation_cap="5 seconds")
    project, tenant = uuid.uuid4(), uuid.uuid4()
    _request(db, project, tenant, "Crud")
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET first_requested_at = now() - interval"
        " '4.5 seconds' WHERE project_id = %s",
        (project,),
    )
    anchor = queue_row(db, project)["first_requested_at"]
    now = _request(db, project, tenant, "PropertyObjectStatusChanged")
    row = queue_row(db, project)
    assert now + SECOND > anchor + 5 * SECOND  # the cap is the smaller bound here
    assert row["due_at"] == anchor + 5 * SECOND
    assert row["first_requested_at"] == anchor
    assert row["requested_count"] == 2
    assert row["last_reason"] == "PropertyObjectStatusChanged"


def test_thresholds_are_read_from_recalc_settings_by_every_enqueue_path(db):
    """Settings changed to debounce 7 s / cap 11 s, then an explicit request and a trigger-raised
    one: both use 7 s; with first_requested_at moved back 10 s the next one is capped at 11 s."""
    set_settings(db, debounce="7 seconds", starvation_cap="11 seconds")
    explicit, tenant = uuid.uuid4(), uuid.uuid4()
    now = _request(db, explicit, tenant, "Crud")
    assert queue_row(db, explicit)["due_at"] == now + 7 * SECOND

    project = make_project(db)
    clear_queue(db)  # the project's own insert enqueued it; the building's trigger is tried here
    with db.transaction():
        now = db.execute("SELECT now()").fetchone()[0]
        make_building(db, project)
    row = queue_row(db, project)
    assert row["due_at"] == now + 7 * SECOND
    assert row["first_requested_at"] == now

    db.execute(
        "UPDATE chessboard.project_recalc_requests SET first_requested_at = now() - interval"
        " '10 seconds' WHERE project_id = %s",
        (project,),
    )
    anchor = queue_row(db, project)["first_requested_at"]
    make_building(db, project)
    assert queue_row(db, project)["due_at"] == anchor + 11 * SECOND


#: Spec 000's thresholds ("пороги (debounce 30 с, cap 5 мин, тик 5 с, batch 50, poison 5)"), as
#: chessboard.recalc_settings holds them; the tick is the retry interval there (a failed row is
#: retried on the next tick) and the recalc sensor's interval.
SPEC_SETTINGS = {
    "debounce": 30 * SECOND,
    "starvation_cap": 300 * SECOND,
    "batch_size": 50,
    "poison_attempts": 5,
    "retry_interval": 5 * SECOND,
}


def test_a_freshly_migrated_database_has_the_spec_thresholds(
    pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Every other test sets the thresholds it needs, so a migration that changed a default
    would pass them all. Read here from the run's template (a database only `pin db migrate`
    has touched; under the lock its copies are made with, which refuse a connected template):
    its settings row, and the columns' defaults a new row would get, are the spec's; so is the
    worker's tick when PIN_RECALC_TICK_SECONDS is unset. Tried: a scratch migration setting the
    debounce to 10 s fails it, naming the debounce."""
    with (
        run_lock(tmp_path_factory, "pg-copy"),
        psycopg.connect(dsn_with_dbname(BASE_TEST_PG_DSN, pg_template)) as conn,
    ):
        cur = conn.execute(f"SELECT {', '.join(SPEC_SETTINGS)} FROM chessboard.recalc_settings")
        rows = [dict(zip(SPEC_SETTINGS, row, strict=True)) for row in cur.fetchall()]
        defaults = conn.execute(
            "SELECT column_name, column_default FROM information_schema.columns"
            " WHERE table_schema = 'chessboard' AND table_name = 'recalc_settings'"
            " AND column_name = ANY(%s)",
            (list(SPEC_SETTINGS),),
        ).fetchall()
        new_row = {
            name: conn.execute(f"SELECT {expression}").fetchone()[0]
            for name, expression in defaults
        }
    assert rows == [SPEC_SETTINGS]
    assert new_row == SPEC_SETTINGS
    assert recalc_tick_seconds({}) == DEFAULT_RECALC_TICK_SECONDS == 5
    assert SPEC_SETTINGS["retry_interval"] == DEFAULT_RECALC_TICK_SECONDS * SECOND


def test_coalescing_burst_of_n_events_is_one_row_and_one_run(db, pg_dsn):
    """A burst of 20 committed price edits of one project (debounce 1 s): one queue row with
    requested_count 20; nothing runs before it is due; once due, one tick recalculates the
    project once (one version bump, one project event) and a second tick finds nothing."""
    set_settings(db, debounce="1 second", starvation_cap="5 seconds")
    project = make_project(db)
    building = make_building(db, project)
    obj = make_object(db, project, building, None, price=100)
    clear_queue(db)

    for i in range(20):
        db.execute(
            "UPDATE chessboard.property_objects SET price = %s WHERE id = %s", (200 + i, obj)
        )
    rows = queued_projects(db)
    assert list(rows) == [project]
    assert rows[project]["requested_count"] == 20

    early = drain_tick(pg_dsn)
    assert early.processed == 0
    assert queue_row(db, project) is not None

    wait = db.execute(
        "SELECT extract(epoch FROM due_at - now())::float8"
        " FROM chessboard.project_recalc_requests WHERE project_id = %s",
        (project,),
    ).fetchone()[0]
    time.sleep(max(0.0, wait) + 0.05)
    tick = drain_tick(pg_dsn)
    assert tick.processed == 1
    assert tick.results[0].requested_count == 20
    assert tick.as_dict()["coalesced_events"] == 20
    assert queued_projects(db) == {}
    assert drain_tick(pg_dsn).processed == 0
    version, price = db.execute(
        "SELECT version, price_min FROM chessboard.projects WHERE id = %s", (project,)
    ).fetchone()
    assert (version, price) == (2, Decimal(219))
    events = db.execute(
        "SELECT count(*) FROM chessboard.outbox_events WHERE message_key = %s", (str(project),)
    ).fetchone()[0]
    assert events == 1


def test_starvation_cap_forces_a_run_at_the_cap_boundary(db, pg_dsn):
    """Edits every 0.3 s (debounce 1 s, cap 3 s) with a drain tick after each: the debounce alone
    would never mature, yet the project is recalculated at first_requested_at + 3 s (not
    before, and within one edit interval after), while the edits are still going on."""
    set_settings(db, debounce="1 second", starvation_cap="3 seconds")
    project = make_project(db)
    building = make_building(db, project)
    obj = make_object(db, project, building, None, price=100)
    clear_queue(db)

    anchor = None
    forced = None  # (previous tick's start, forcing tick's end), seconds after the anchor
    previous_start = None
    price = 100
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:
        price += 1
        with db.transaction():
            now = db.execute("SELECT now()").fetchone()[0]
            db.execute(
                "UPDATE chessboard.property_objects SET price = %s WHERE id = %s", (price, obj)
            )
        row = queue_row(db, project)
        if anchor is None:
            anchor = row["first_requested_at"]
        # Trailing debounce until the cap, then pinned to the cap.
        assert row["due_at"] == min(now + SECOND, anchor + 3 * SECOND)

        started = (_clock(db) - anchor).total_seconds()
        tick = drain_tick(pg_dsn)
        if tick.processed:
            forced = (previous_start, (_clock(db) - anchor).total_seconds())
            assert tick.results[0].requested_count >= 8
            break
        previous_start = started
        time.sleep(0.3)

    assert forced is not None, "continuous edits starved the project"
    # Not before the cap, and at the first tick after it: the tick before ran before the cap.
    assert forced[1] >= 3.0
    assert forced[0] is not None and forced[0] < 3.0
    assert db.execute(
        "SELECT price_max FROM chessboard.projects WHERE id = %s", (project,)
    ).fetchone()[0] == Decimal(price)
    # The window closed: the next edit opens a fresh one anchored at its own time.
    with db.transaction():
        now = db.execute("SELECT now()").fetchone()[0]
        db.execute("UPDATE chessboard.property_objects SET price = price + 1 WHERE id = %s", (obj,))
    row = queue_row(db, project)
    assert (row["first_requested_at"], row["requested_count"]) == (now, 1)


# --- raisers: triggers on the source tables ------------------------------------------------

RAW_EDITS = [
    pytest.param(
        "INSERT INTO chessboard.property_objects (id, project_id, building_id, layout_id, status,"
        " price) VALUES (gen_random_uuid(), %(project)s, %(building)s, %(layout)s, 'Free', 5)",
        "PropertyObjectUpserted",
        id="object-insert",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET status = 'Sold' WHERE id = %(obj)s",
        "PropertyObjectStatusChanged",
        id="object-status",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET price = 777 WHERE id = %(obj)s",
        "PropertyObjectPriceChanged",
        id="object-price",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET status = 'Booked', price = 1 WHERE id = %(obj)s",
        "PropertyObjectStatusChanged",
        id="object-status-and-price",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET layout_id = NULL WHERE id = %(obj)s",
        "PropertyObjectUpserted",
        id="object-layout",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %(obj)s",
        "PropertyObjectUpserted",
        id="object-soft-delete",
    ),
    pytest.param(
        "DELETE FROM chessboard.property_objects WHERE id = %(obj)s",
        "PropertyObjectUpserted",
        id="object-hard-delete",
    ),
    pytest.param(
        "INSERT INTO chessboard.layouts (id, project_id, layout_group_id, name, total_area)"
        " VALUES (gen_random_uuid(), %(project)s, %(group)s, 'L2', 55)",
        "LayoutChanged",
        id="layout-insert",
    ),
    pytest.param(
        "UPDATE chessboard.layouts SET total_area = 41 WHERE id = %(layout)s",
        "LayoutChanged",
        id="layout-area",
    ),
    pytest.param(
        "UPDATE chessboard.layouts SET layout_group_id = NULL WHERE id = %(layout)s",
        "LayoutChanged",
        id="layout-group-change",
    ),
    pytest.param(
        "UPDATE chessboard.layouts SET deleted_at = now() WHERE id = %(layout)s",
        "LayoutChanged",
        id="layout-soft-delete",
    ),
    pytest.param(
        "INSERT INTO chessboard.buildings (id, project_id, name)"
        " VALUES (gen_random_uuid(), %(project)s, 'B2')",
        "Crud",
        id="building-insert",
    ),
    pytest.param(
        "UPDATE chessboard.buildings SET name = 'renamed' WHERE id = %(building)s",
        "Crud",
        id="building-update",
    ),
    pytest.param(
        "UPDATE chessboard.buildings SET deleted_at = now() WHERE id = %(building)s",
        "Crud",
        id="building-soft-delete",
    ),
]


@pytest.mark.parametrize(("statement", "reason"), RAW_EDITS)
def test_raw_sql_edit_enqueues_its_project_with_the_spec_reason(db, statement, reason):
    """A raw SQL insert/update/soft delete of property_objects, layouts or buildings (no
    application code involved) leaves exactly its project queued once, with the spec's reason
    (status > price > other for objects; LayoutChanged; Crud), tenant and debounce."""
    set_settings(db, debounce="1 second", starvation_cap="5 seconds")
    tree = _project_with_tree(db)
    make_project(db)  # a bystander project must stay out of the queue
    clear_queue(db)
    with db.transaction():
        now = db.execute("SELECT now()").fetchone()[0]
        db.execute(statement, tree)
    rows = queued_projects(db)
    assert list(rows) == [tree["project"]]
    row = rows[tree["project"]]
    assert row["last_reason"] == reason
    assert row["requested_count"] == 1
    assert row["tenant_id"] == _tenant(db, tree["project"])
    assert row["due_at"] == now + SECOND


def test_raiser_enqueues_in_the_writers_transaction(db, pg_dsn):
    """An object edit inside an open transaction: the queue row is invisible to others until
    commit, and a rolled-back edit leaves no row (the trigger is not lost, nor invented)."""
    tree = _project_with_tree(db)
    clear_queue(db)
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        with db.transaction():
            db.execute(
                "UPDATE chessboard.property_objects SET price = 1 WHERE id = %s", (tree["obj"],)
            )
            assert queue_row(db, tree["project"]) is not None
            assert queue_row(other, tree["project"]) is None
            raise psycopg.Rollback()
        assert queue_row(other, tree["project"]) is None
        with db.transaction():
            db.execute(
                "UPDATE chessboard.property_objects SET price = 2 WHERE id = %s", (tree["obj"],)
            )
            assert queue_row(other, tree["project"]) is None
        assert queue_row(other, tree["project"])["last_reason"] == "PropertyObjectPriceChanged"


def test_bulk_update_of_10000_objects_enqueues_once(db):
    """10,000 objects of one project inserted by one statement, then all repriced by one UPDATE:
    each statement adds exactly one request (requested_count 1 after each, not 10,000)."""
    project = make_project(db)
    building = make_building(db, project)
    clear_queue(db)
    db.execute(
        "INSERT INTO chessboard.property_objects (id, project_id, building_id, status, price)"
        " SELECT gen_random_uuid(), %s, %s, 'Free', g FROM generate_series(1, 10000) g",
        (project, building),
    )
    row = queue_row(db, project)
    assert (row["requested_count"], row["last_reason"]) == (1, "PropertyObjectUpserted")
    clear_queue(db)
    result = db.execute(
        "UPDATE chessboard.property_objects SET price = price + 1 WHERE project_id = %s",
        (project,),
    )
    assert result.rowcount == 10_000
    rows = queued_projects(db)
    assert list(rows) == [project]
    assert (rows[project]["requested_count"], rows[project]["last_reason"]) == (
        1,
        "PropertyObjectPriceChanged",
    )


def test_object_moved_to_another_project_enqueues_both_projects(db):
    """An object re-parented to another project (project_id, building_id and layout_id all
    changed by one UPDATE): both the old and the new project are queued."""
    a = _project_with_tree(db)
    b = _project_with_tree(db)
    clear_queue(db)
    db.execute(
        "UPDATE chessboard.property_objects SET project_id = %s, building_id = %s, layout_id = %s"
        " WHERE id = %s",
        (b["project"], b["building"], b["layout"], a["obj"]),
    )
    rows = queued_projects(db)
    assert set(rows) == {a["project"], b["project"]}
    assert {r["tenant_id"] for r in rows.values()} == {
        _tenant(db, a["project"]),
        _tenant(db, b["project"]),
    }


def test_layout_moved_to_another_project_enqueues_both_projects(db):
    """A layout re-parented to another project and group: both projects queued (LayoutChanged)."""
    a = _project_with_tree(db)
    b = _project_with_tree(db)
    clear_queue(db)
    db.execute(
        "UPDATE chessboard.layouts SET project_id = %s, layout_group_id = %s WHERE id = %s",
        (b["project"], b["group"], a["layout"]),
    )
    rows = queued_projects(db)
    assert set(rows) == {a["project"], b["project"]}
    assert {r["last_reason"] for r in rows.values()} == {"LayoutChanged"}


def test_layout_group_moved_to_another_project_enqueues_both_projects(db, pg_dsn):
    """A layout group re-parented to another project (its layouts follow): both projects queued,
    and the drain's own group writes (counts, bounds, version) enqueue nothing."""
    a = _project_with_tree(db)
    b = _project_with_tree(db)
    drain_all(pg_dsn, db)
    db.execute(
        "UPDATE chessboard.layout_groups SET project_id = %s WHERE id = %s",
        (b["project"], a["group"]),
    )
    rows = queued_projects(db)
    assert set(rows) == {a["project"], b["project"]}
    assert {r["last_reason"] for r in rows.values()} == {"Crud"}
    drain_all(pg_dsn, db)
    assert queued_projects(db) == {}


CROSS_PROJECT_REFERENCES = [
    pytest.param(
        "UPDATE chessboard.property_objects SET layout_id = %(b_layout)s WHERE id = %(a_obj)s",
        id="object-layout-of-other-project",
    ),
    pytest.param(
        "UPDATE chessboard.property_objects SET building_id = %(b_building)s WHERE id = %(a_obj)s",
        id="object-building-of-other-project",
    ),
    pytest.param(
        "UPDATE chessboard.layouts SET layout_group_id = %(b_group)s WHERE id = %(a_layout)s",
        id="layout-group-of-other-project",
    ),
]


@pytest.mark.parametrize("statement", CROSS_PROJECT_REFERENCES)
def test_reference_across_projects_leaves_no_aggregate_stale(db, pg_dsn, statement):
    """A row of project A pointed at project B's layout/building/group (A's project_id kept):
    draining what the raisers queued gives the same aggregates as recalculating every project,
    i.e. the other side is either queued or does not depend on the edit."""
    a = _project_with_tree(db)
    b = _project_with_tree(db)
    drain_all(pg_dsn, db)
    db.execute(statement, {f"a_{k}": v for k, v in a.items()} | {f"b_{k}": v for k, v in b.items()})
    assert a["project"] in queued_projects(db)
    drain_all(pg_dsn, db)
    after_triggered = actual_aggregates(db)
    for project in (a["project"], b["project"]):
        force_recalc(pg_dsn, project)
    drain_all(pg_dsn, db)
    assert actual_aggregates(db) == after_triggered
    assert drift(db) == {}


def test_drain_own_writes_do_not_enqueue_again(db, pg_dsn):
    """A drain that rewrites counters and versions of the project, its buildings, layouts and
    groups leaves the queue empty; the same kind of write made outside a drain (only counters,
    version and updated_at of buildings and layouts) enqueues nothing either: the recalc's own
    columns are not raiser edits."""
    tree = _project_with_tree(db)
    make_object(db, tree["project"], tree["building"], tree["layout"], status="Sold", price=5)
    tick = drain_due(pg_dsn, db)
    assert tick.processed == 1
    assert tick.results[0].buildings_updated == 1
    assert tick.results[0].republished == {"layout": 1, "layout_group": 1, "project": 1}
    assert queued_projects(db) == {}

    db.execute(
        "UPDATE chessboard.buildings SET property_objects_total_count = 7,"
        " property_objects_free_count = 3, version = version + 1, updated_at = now()"
        " WHERE id = %s",
        (tree["building"],),
    )
    db.execute(
        "UPDATE chessboard.layouts SET property_objects_count = 9, version = version + 1,"
        " updated_at = now() WHERE id = %s",
        (tree["layout"],),
    )
    db.execute(
        "UPDATE chessboard.property_objects SET version = version + 1, updated_at = now()"
        " WHERE project_id = %s",
        (tree["project"],),
    )
    assert queued_projects(db) == {}


def test_the_due_index_is_a_btree_on_due_at(db):
    """Spec 000: index ix_project_recalc_due btree(due_at), the selection of due rows. Tried:
    the index as the catalogue holds it. Broken on purpose (migration 0001 creating it on
    (due_at, project_id)): this test failed."""
    definition = db.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'chessboard'"
        " AND indexname = 'ix_project_recalc_due'"
    ).fetchone()
    assert definition == (
        "CREATE INDEX ix_project_recalc_due ON chessboard.project_recalc_requests"
        " USING btree (due_at)",
    )


def test_a_queue_rows_created_at_is_its_insert_and_updated_at_moves_with_each_upsert(db):
    """Spec 000: CreatedAt / UpdatedAt of the queue row. Tried: three requests for one project
    in three transactions. created_at is the first one's now() and stays; updated_at is each
    request's now() (the coalesced upserts move it). Broken on purpose (`updated_at = now()`
    left out of the upsert in migration 0001): updated_at stayed at the first request's."""
    project, tenant = uuid.uuid4(), uuid.uuid4()
    first = _request(db, project, tenant, "Crud")
    row = queue_row(db, project)
    assert (row["created_at"], row["updated_at"]) == (first, first)
    for reason in ("PropertyObjectPriceChanged", "LayoutChanged"):
        later = _request(db, project, tenant, reason)
        assert later > first
        row = queue_row(db, project)
        assert (row["created_at"], row["updated_at"]) == (first, later)


def test_a_recomputed_rows_updated_at_is_its_recompute_transactions_now(db, pg_dsn):
    """Spec 000 postcondition: Version of the touched rows += 1, UpdatedAt = now(). Tried: a
    project whose object was hidden and whose layout group got a second layout after its tree
    was recomputed, drained: the
    project, its building, layout and layout group each get version + 1 and the SAME
    updated_at, one later than the clock before the tick and no later than after it: one
    transaction's now(), not the time of each statement. Broken on purpose (clock_timestamp()
    for the building's updated_at in migration 0016): the four updated_at differed."""
    tree = _project_with_tree(db)
    drain_all(pg_dsn, db)
    tables = {
        "projects": ("id", tree["project"]),
        "buildings": ("id", tree["building"]),
        "layouts": ("id", tree["layout"]),
        "layout_groups": ("id", tree["group"]),
    }

    def rows() -> dict[str, tuple[int, object]]:
        return {
            table: db.execute(
                f"SELECT version, updated_at FROM chessboard.{table} WHERE {key} = %s", (value,)
            ).fetchone()
            for table, (key, value) in tables.items()
        }

    before = rows()
    db.execute(
        "UPDATE chessboard.property_objects SET status = 'Hidden' WHERE id = %s", (tree["obj"],)
    )
    make_layout(db, tree["project"], tree["group"], 55)  # the group: 2 layouts, area to 55
    clock = _clock(db)
    tick = drain_due(pg_dsn, db)
    after_clock = _clock(db)
    assert tick.processed == 1
    after = rows()
    assert {t: v for t, (v, _) in after.items()} == {t: v + 1 for t, (v, _) in before.items()}
    stamps = {t: at for t, (_, at) in after.items()}
    assert len(set(stamps.values())) == 1, stamps
    assert clock < stamps["projects"] <= after_clock


def test_the_queue_takes_exactly_the_known_reasons_and_refuses_any_other(db):
    """The queue's reasons are spec 000's RecalcTriggerReason plus the two operator paths
    (`Manual`: `pin recalc request` and the force-recalc job; `Reconcile`: `pin reconcile
    --repair`), docs/spec-readings.md. Tried: every RecalcReason through
    request_project_recalc (each one taken: the enum and the column's CHECK agree), then an
    unknown reason for a project not queued and for a queued one (refused with check_violation:
    no row made, the queued row as it was), and `pin recalc request --reason` with it (one line
    listing the reasons, nothing queued). This already held; no test read it."""
    project = make_project(db)
    tenant = _tenant(db, project)
    clear_queue(db)
    for reason in RecalcReason:
        _request(db, project, tenant, str(reason))
        assert queue_row(db, project)["last_reason"] == str(reason)
    queued = queue_row(db, project)
    assert queued["requested_count"] == len(RecalcReason)

    other = make_project(db)
    clear_queue(db)
    _request(db, project, tenant, "Manual")
    queued = queue_row(db, project)
    for target in (other, project):
        with pytest.raises(psycopg.errors.CheckViolation):
            _request(db, target, tenant, "PriceChanged")
    assert queue_row(db, other) is None
    assert queue_row(db, project) == queued

    refused = run_pin("recalc", "request", "--project-id", str(other), "--reason", "PriceChanged")
    assert_one_line_error(refused, "--reason must be one of", *(str(r) for r in RecalcReason))
    assert queue_row(db, other) is None
