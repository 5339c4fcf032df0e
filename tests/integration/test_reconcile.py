"""Drift of every kind is found, repair goes through the normal pipeline (drain → relay →
loader) and a second reconciliation reports zero drift; a consistent database reports none.

Real PostgreSQL, Kafka and the embedded ClickHouse; a missing service fails these tests.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import uuid
from collections.abc import Callable
from contextlib import redirect_stdout
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import dagster as dg
import psycopg
import pytest

from pin_pipelines.cli import main
from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.config import Settings
from pin_pipelines.definitions import defs
from pin_pipelines.devstats.dim import labels
from pin_pipelines.devstats.events import COLUMNS
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.reconcile import (
    Snapshot,
    aggregates_drift,
    compare,
    dim_layout_group_drift,
    reconcile,
    versions_behind,
)
from tests.support.chessboard import make_layout_group, make_object, small_project
from tests.support.recalc import drain_until_empty

DIM = "pin_dev_stats.dim_layout_group"


# --- helpers -----------------------------------------------------------------------------------


def cells(drift_rows: list) -> set[tuple[str, UUID, str, str | None, str | None]]:
    return {
        (r.entity, r.id, r.column, r.as_dict()["stored"], r.as_dict()["expected"])
        for r in drift_rows
    }


# --- aggregates ----------------------------------------------------------------------------------


def test_each_kind_of_aggregate_drift_is_found_and_repaired(
    db: psycopg.Connection, pg_dsn: str, settings: Settings, ch: ClickHouse
) -> None:
    ids = small_project(db)
    healthy = small_project(db)
    drain_until_empty(db, pg_dsn)
    assert aggregates_drift(pg_dsn).rows == []

    # Writes that bypass the recalc (a bug, a manual fix gone wrong): no raiser enqueues them.
    db.execute(
        "UPDATE chessboard.projects SET property_objects_total_count = 7, price_min = 999"
        " WHERE id = %s",
        (ids["project"],),
    )
    db.execute(
        "UPDATE chessboard.buildings SET property_objects_free_count = 0 WHERE id = %s",
        (ids["building"],),
    )
    db.execute(
        "UPDATE chessboard.layouts SET property_objects_count = 5 WHERE id = %s", (ids["big"],)
    )
    db.execute(
        "UPDATE chessboard.layout_groups SET layouts_count = 4, area_min = NULL, area_max = 99"
        " WHERE id = %s",
        (ids["studios"],),
    )
    assert db.execute("SELECT count(*) FROM chessboard.project_recalc_requests").fetchone() == (0,)

    drift = aggregates_drift(pg_dsn)
    assert cells(drift.rows) == {
        ("project", ids["project"], "property_objects_total_count", "7", "3"),
        ("project", ids["project"], "price_min", "999", "1000"),
        ("building", ids["building"], "property_objects_free_count", "0", "2"),
        ("layout", ids["big"], "property_objects_count", "5", "1"),
        ("layout_group", ids["studios"], "layouts_count", "4", "2"),
        ("layout_group", ids["studios"], "area_min", None, "25.5"),
        ("layout_group", ids["studios"], "area_max", "99", "31"),
    }
    assert drift.drifted == {"project": 1, "building": 1, "layout": 1, "layout_group": 1}
    assert drift.project_ids == [ids["project"]]
    assert drift.unexplained == [ids["project"]]  # not queued: nothing would fix it
    assert healthy["project"] not in drift.project_ids

    report = reconcile(settings, repair=True)
    assert report.repair is not None and report.repair.projects_enqueued == 1
    queued = db.execute(
        "SELECT project_id, last_reason, due_at <= now() FROM chessboard.project_recalc_requests"
    ).fetchall()
    assert queued == [(ids["project"], "Reconcile", True)]

    drain_tick(pg_dsn)  # the normal worker tick, no clock tricks: the row is due now
    after = aggregates_drift(pg_dsn)
    assert after.rows == [] and after.project_ids == []


def test_a_recent_edit_is_drift_that_the_queue_already_covers(
    db: psycopg.Connection, pg_dsn: str
) -> None:
    ids = small_project(db)
    drain_until_empty(db, pg_dsn)
    make_object(db, ids["project"], ids["building"], ids["big"], status="Free", price=50)

    drift = aggregates_drift(pg_dsn)
    assert drift.project_ids == [ids["project"]]
    assert drift.queued == {ids["project"]} and drift.unexplained == []
    assert ("project", ids["project"], "price_min", "1000", "50") in cells(drift.rows)

    db.execute(
        "UPDATE chessboard.project_recalc_requests SET attempt_count = 5 WHERE project_id = %s",
        (ids["project"],),
    )
    poisoned = aggregates_drift(pg_dsn)
    assert poisoned.poisoned == {ids["project"]} and poisoned.unexplained == [ids["project"]]


def test_archived_projects_are_not_checked(db: psycopg.Connection, pg_dsn: str) -> None:
    ids = small_project(db)
    drain_until_empty(db, pg_dsn)
    db.execute(
        "UPDATE chessboard.projects SET status = 'Archived' WHERE id = %s", (ids["project"],)
    )
    db.execute("UPDATE chessboard.projects SET price_max = 1 WHERE id = %s", (ids["project"],))
    drift = aggregates_drift(pg_dsn)
    assert drift.rows == [] and drift.checked["project"] == 0


def random_database(conn: psycopg.Connection, projects: int, seed: int) -> None:
    """Random hierarchies written like the API writes them (COPY, so the raisers run per
    statement): empty projects, groups without layouts, layouts without group, soft-deleted
    objects and layouts, every status, archived projects and a few cross-project references."""
    rnd = random.Random(seed)
    rows: dict[str, list[tuple[object, ...]]] = {
        "projects": [],
        "buildings": [],
        "layout_groups": [],
        "layouts": [],
        "property_objects": [],
    }
    deleted = datetime(2024, 1, 1, tzinfo=UTC)
    all_buildings: list[UUID] = []
    for _ in range(projects):
        pid = uuid.uuid4()
        status = rnd.choice(["Draft", "Published", "Published", "Hidden", "Archived"])
        rows["projects"].append((pid, uuid.uuid4(), f"P {pid.hex[:6]}", status))
        buildings = [uuid.uuid4() for _ in range(rnd.randint(0, 3))]
        all_buildings += buildings
        rows["buildings"] += [(b, pid, "B") for b in buildings]
        groups = [uuid.uuid4() for _ in range(rnd.randint(0, 4))]
        rows["layout_groups"] += [
            (g, pid, rnd.choice(["Студии", "Люкс"]), i, rnd.random() < 0.1)
            for i, g in enumerate(groups)
        ]
        layouts = [uuid.uuid4() for _ in range(rnd.randint(0, 8))]
        rows["layouts"] += [
            (
                lay,
                pid,
                rnd.choice([*groups, None]) if groups else None,
                Decimal(rnd.randint(180, 1500)) / 10,
                deleted if rnd.random() < 0.1 else None,
            )
            for lay in layouts
        ]
        for _ in range(rnd.randint(0, 120) if buildings else 0):
            building = rnd.choice(buildings)
            if all_buildings and rnd.random() < 0.005:
                building = rnd.choice(all_buildings)  # another project's building
            rows["property_objects"].append(
                (
                    uuid.uuid4(),
                    pid,
                    building,
                    rnd.choice([*layouts, None]) if layouts else None,
                    rnd.choice(["Free", "Free", "Booked", "Sold", "Hidden", "Reserved"]),
                    Decimal(rnd.randint(1_000_000, 30_000_000)),
                    deleted if rnd.random() < 0.05 else None,
                )
            )
    columns = {
        "projects": "id, tenant_id, name, status",
        "buildings": "id, project_id, name",
        "layout_groups": "id, project_id, name, sort_order, is_archived",
        "layouts": "id, project_id, layout_group_id, total_area, deleted_at",
        "property_objects": "id, project_id, building_id, layout_id, status, price, deleted_at",
    }
    with conn.cursor() as cur:
        for table, cols in columns.items():
            with cur.copy(f"COPY chessboard.{table} ({cols}) FROM STDIN") as copy:
                for row in rows[table]:
                    copy.write_row(row)


def test_no_false_positives_on_1000_random_projects_and_their_dimension(
    db: psycopg.Connection, settings: Settings, ch: ClickHouse, pipeline: Callable[[], None]
) -> None:
    random_database(db, projects=1000, seed=6)
    run = pipeline
    run()
    drift = aggregates_drift(settings.pg_dsn)
    assert drift.rows == [], drift.rows[:5]
    assert drift.checked["project"] > 700 and drift.checked["layout"] > 2000

    # Groups of projects created archived were never published (spec 000: the drain of an
    # archived project is a no-op): real dimension drift (the row lives as long as the group),
    # missing rows only, healed by one repair; after it the dimension is exactly its source.
    # (One CI run also found 252 groups of live projects missing after one pass; locally none
    # were. Not understood yet: see the sixth stop's closing note.)
    first = reconcile(settings, repair=True)
    assert first.as_dict()["projects_drifted"] == 0
    retired_groups = db.execute(
        "SELECT g.id FROM chessboard.layout_groups g JOIN chessboard.projects p"
        " ON p.id = g.project_id WHERE p.status = 'Archived' OR p.deleted_at IS NOT NULL"
    ).fetchall()
    assert {g for (g,) in retired_groups} <= set(first.dim.kinds)
    assert set(first.dim.kinds.values()) <= {"missing"}
    run()
    second = reconcile(settings).as_dict()
    assert (second["projects_drifted"], second["dim_rows_drifted"]) == (0, 0), second
    groups = db.execute("SELECT count(*) FROM chessboard.layout_groups").fetchone()
    assert groups is not None and second["dim_rows_checked"] == groups[0]


# --- dimension -----------------------------------------------------------------------------------


def insert_dim_row(ch: ClickHouse, row: tuple[object, ...]) -> None:
    ch.insert(DIM, COLUMNS, [row])


def test_each_kind_of_dimension_drift_is_found_and_heals_through_the_pipeline(
    db: psycopg.Connection, settings: Settings, ch: ClickHouse, pipeline: Callable[[], None]
) -> None:
    run = pipeline
    ids = small_project(db)
    other = small_project(db)
    run()
    reconcile(settings, repair=True)  # the groups' first publication
    run()
    assert reconcile(settings).dim.kinds == {}

    tenant = db.execute(
        "SELECT tenant_id FROM chessboard.projects WHERE id = %s", (ids["project"],)
    ).fetchone()
    assert tenant is not None
    # Source edits whose events were lost, and a row written into the dimension by hand.
    db.execute("UPDATE chessboard.layout_groups SET name = 'Renamed' WHERE id = %s", (ids["lux"],))
    db.execute(
        "UPDATE chessboard.layout_groups SET sort_order = 42, version = version + 1 WHERE id = %s",
        (ids["studios"],),
    )
    db.execute(
        "UPDATE chessboard.layout_groups SET is_archived = true WHERE id = %s", (other["lux"],)
    )
    stored = db.execute(
        "SELECT name, sort_order, version FROM chessboard.layout_groups WHERE id = %s",
        (other["studios"],),
    ).fetchone()
    assert stored is not None
    wrong_parent = uuid.uuid4()
    insert_dim_row(
        ch,
        (
            other["studios"],
            wrong_parent,
            tenant[0],
            stored[0],
            stored[1],
            0,
            stored[2],
            datetime.now(UTC),
        ),
    )
    missing = make_layout_group(db, ids["project"], "Новая группа")  # never published

    drift = dim_layout_group_drift(settings.pg_dsn, ch)
    assert drift.kinds == {
        ids["lux"]: "different",
        ids["studios"]: "stale_version",
        other["lux"]: "different",
        other["studios"]: "different",
        missing: "missing",
    }
    found = {(r.id, r.column) for r in drift.rows}
    assert {
        (ids["lux"], "name"),
        (ids["studios"], "sort_order"),
        (ids["studios"], "version"),
        (other["lux"], "is_archived"),
        (other["studios"], "project_id"),
        (other["studios"], "developer_id"),
        (missing, "row"),
    } == found

    # The same version re-published would be skipped by the loader's guard: repair bumps it.
    versions_before: dict[UUID, int] = dict(
        db.execute("SELECT id, version FROM chessboard.layout_groups")
    )
    report = reconcile(settings, repair=True)
    assert report.repair is not None and report.repair.layout_groups_republished == 5
    versions_after: dict[UUID, int] = dict(
        db.execute("SELECT id, version FROM chessboard.layout_groups")
    )
    assert all(versions_after[g] == versions_before[g] + 1 for g in drift.kinds)

    run()
    summary = reconcile(settings).as_dict()
    assert (summary["projects_drifted"], summary["dim_rows_drifted"]) == (0, 0), summary
    assert summary["dim_drift_by_kind"] == dict.fromkeys(summary["dim_drift_by_kind"], 0)


def test_a_group_whose_developer_is_not_its_projects_is_drift_that_repair_fixes(
    db: psycopg.Connection, settings: Settings, ch: ClickHouse, pipeline: Callable[[], None]
) -> None:
    """The dimension is compared with the hierarchy, not with the group's copy of its developer.
    Tried: a project's two groups loaded; then the project passed from A to B by a session with
    session_replication_role = replica, which bypasses the triggers that keep the groups' copy
    (as every such edit did before migration 0022): the groups' tenant_id and their dimension
    rows keep A, at the same version. Compared with that stale column, the reconciliation found
    nothing. Now both rows are drift ("different", column developer_id: stored A, expected B);
    `--repair` sets the groups' tenant_id to B and re-publishes them above the dimension's
    version, and after relay and load the reconciliation finds none, B reads the names and A the
    ids."""
    ids = small_project(db)
    groups_of_project = [ids["studios"], ids["lux"]]
    pipeline()
    assert reconcile(settings).dim.kinds == {}
    old = db.execute(
        "SELECT tenant_id FROM chessboard.projects WHERE id = %s", (ids["project"],)
    ).fetchone()
    assert old is not None
    new = uuid.uuid4()
    db.execute("SET session_replication_role = replica")
    db.execute("UPDATE chessboard.projects SET tenant_id = %s WHERE id = %s", (new, ids["project"]))
    db.execute("RESET session_replication_role")
    tenants = db.execute(
        "SELECT DISTINCT tenant_id FROM chessboard.layout_groups WHERE project_id = %s",
        (ids["project"],),
    ).fetchall()
    assert tenants == [old]  # the copy is stale

    drift = dim_layout_group_drift(settings.pg_dsn, ch)
    assert drift.kinds == dict.fromkeys(groups_of_project, "different")
    assert cells(drift.rows) == {
        ("dim_layout_group", g, "developer_id", str(old[0]), str(new)) for g in groups_of_project
    }

    report = reconcile(settings, repair=True)
    assert report.repair is not None and report.repair.layout_groups_republished == 2
    tenants = db.execute(
        "SELECT DISTINCT tenant_id FROM chessboard.layout_groups WHERE project_id = %s",
        (ids["project"],),
    ).fetchall()
    assert tenants == [(new,)]
    pipeline()
    summary = reconcile(settings).as_dict()
    assert (summary["projects_drifted"], summary["dim_rows_drifted"]) == (0, 0), summary
    names = {str(ids["studios"]): "Студии", str(ids["lux"]): "Люкс с видом на море"}
    assert labels(ch, new, groups_of_project) == names
    assert labels(ch, old[0], groups_of_project) == {g: g for g in names}


def test_versions_check_fails_only_for_rows_behind_past_the_sla(
    db: psycopg.Connection,
    settings: Settings,
    ch: ClickHouse,
    chdb_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dim_layout_group_versions_current, run as its schedule runs it: a row with an older
    SourceVersion, and a group without any row, fail the check once the group changed more than
    the 5-minute SLA ago (every group is published once it exists, even without layouts). A group
    changed just now is on its way; a row at the source's version with another name is the drift
    asset's business."""
    ids = small_project(db)
    in_sync, stale, renamed = ids["studios"], ids["lux"], make_layout_group(db, ids["project"])
    for row in db.execute(
        "SELECT id, project_id, tenant_id, name, sort_order, is_archived::int, version"
        " FROM chessboard.layout_groups WHERE id = ANY(%s)",
        ([in_sync, stale, renamed],),
    ):
        name = "Old name" if row[0] == renamed else row[3]
        insert_dim_row(ch, (*row[:3], name, *row[4:], datetime.now(UTC)))
    missing_new = make_layout_group(db, ids["project"], "Только что")
    missing_old = make_layout_group(db, ids["project"], "Давно")
    ten_minutes_ago = "now() - interval '10 minutes'"
    db.execute(
        f"UPDATE chessboard.layout_groups SET version = version + 1, updated_at = {ten_minutes_ago}"
        " WHERE id = %s",
        (stale,),
    )
    db.execute(
        f"UPDATE chessboard.layout_groups SET updated_at = {ten_minutes_ago} WHERE id = %s",
        (missing_old,),
    )

    found = versions_behind(settings.pg_dsn, ch, grace_seconds=300)
    assert (found.stale, found.stale_overdue) == ([stale], [stale])
    assert found.missing == sorted([missing_new, missing_old], key=str)
    assert found.missing_overdue == [missing_old]

    monkeypatch.setenv("PIN_CLICKHOUSE_URL", chdb_url)
    schedule = defs.resolve_schedule_def("dim_layout_group_versions_schedule")
    job = defs.resolve_job_def(schedule.job_name)
    with dg.DagsterInstance.ephemeral() as instance:
        [check] = job.execute_in_process(instance=instance).get_asset_check_evaluations()
        assert check.check_name == "dim_layout_group_versions_current" and not check.passed
        facts: dict[str, Any] = {k: getattr(v, "value", v) for k, v in check.metadata.items()}
        assert (facts["rows_behind"], facts["rows_behind_past_sla"]) == (1, 1)
        assert facts["behind_past_sla_ids"] == [str(stale)]
        assert (facts["groups_missing"], facts["groups_missing_past_sla"]) == (2, 1)
        assert facts["missing_past_sla_ids"] == [str(missing_old)]

        def arrives(group: UUID) -> None:
            source = db.execute(
                "SELECT id, project_id, tenant_id, name, sort_order, is_archived::int, version"
                " FROM chessboard.layout_groups WHERE id = %s",
                (group,),
            ).fetchone()
            assert source is not None
            insert_dim_row(ch, (*source, datetime.now(UTC)))  # a later UpsertedAt wins argMax

        # The late event arrives: the row is current, the group past the SLA still fails it.
        arrives(stale)
        [check] = job.execute_in_process(instance=instance).get_asset_check_evaluations()
        assert not check.passed
        assert check.metadata["rows_behind"].value == 0
        assert check.metadata["groups_missing_past_sla"].value == 1
        # Its event arrives too: the check passes; the group changed just now is still counted.
        arrives(missing_old)
        [check] = job.execute_in_process(instance=instance).get_asset_check_evaluations()
        assert check.passed
        assert check.metadata["groups_missing"].value == 1


def test_a_dimension_row_without_source_group_is_reported_not_deleted(
    db: psycopg.Connection, settings: Settings, ch: ClickHouse
) -> None:
    ghost = uuid.uuid4()
    insert_dim_row(ch, (ghost, uuid.uuid4(), uuid.uuid4(), "Ghost", 1, 0, 3, datetime.now(UTC)))
    report = reconcile(settings, repair=True)
    assert report.dim.kinds == {ghost: "unexpected"}
    assert report.repair is not None and report.repair.layout_groups_republished == 0
    assert ch.rows(f"SELECT count() FROM {DIM} WHERE LayoutGroupId = %(id)s", {"id": ghost}) == [
        (1,)
    ]


def test_ahead_version_is_bumped_past_the_dimension() -> None:
    """A dimension ahead of its source (a restored database) heals only with a higher Version."""
    gid, pid, dev = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    row = Snapshot(
        project_id=pid, developer_id=dev, name="A", sort_order=1, is_archived=False, version=3
    )
    drift = compare({gid: row}, {gid: dataclasses.replace(row, version=9)})
    assert drift.kinds == {gid: "ahead_version"} and drift.republish == {gid: 9}


def test_cli_prints_the_contract_summary_last(
    db: psycopg.Connection, settings: Settings, ch: ClickHouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_project(db)
    for name, value in (
        ("PIN_PG_DSN", settings.pg_dsn),
        ("PIN_CLICKHOUSE_URL", settings.clickhouse_url),
    ):
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["reconcile"]) == 0
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    assert summary["projects_checked"] == 1 and summary["projects_drifted"] == 1
    assert {"dim_rows_checked", "dim_rows_drifted"} <= summary.keys()
    assert summary["repaired"] is None
