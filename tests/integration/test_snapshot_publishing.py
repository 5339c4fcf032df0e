"""Every change of a published snapshot is published (issue 13, contract section 4): a layout
group's own fields reach dim_layout_group through drain → relay → loader, a new group is
published once, a project's own fields are published, and a restored project is recomputed."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

import psycopg

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.devstats.dim import groups, labels
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.recalc import drain_until_empty, outbox, queue_row
from tests.support.truth import drift

PROJECT_TOPIC = "pin.chessboard.project-upserted.v1"


def _tenant(conn: psycopg.Connection, project) -> object:
    row = conn.execute("SELECT tenant_id FROM chessboard.projects WHERE id = %s", (project,))
    return row.fetchone()[0]


def test_group_rename_resort_archive_and_an_empty_group_reach_the_dimension(
    db: psycopg.Connection, ch: ClickHouse, pipeline: Callable[[], None]
) -> None:
    """Tried: three groups with layouts are loaded; then one is renamed, one re-sorted, one
    archived, and a fourth is created without layouts. None of these moves an aggregate, so
    before issue 13 nothing was published and the labels kept the old names forever. Now the
    drain publishes each with Version + 1, and after relay and load the dimension (labels and
    groups) shows the new names, order and archive flag, and the empty group. A further
    pipeline run with no change publishes nothing."""
    project = make_project(db)
    building = make_building(db, project)
    studios, lux, penthouses = (
        make_layout_group(db, project, name) for name in ("Студии", "Люкс", "Пентхаусы")
    )
    for group, area in ((studios, 25), (lux, 120), (penthouses, 300)):
        layout = make_layout(db, project, group, Decimal(area))
        make_object(db, project, building, layout, status="Free", price=1000)
    pipeline()
    developer = _tenant(db, project)
    assert labels(ch, developer, [studios, lux, penthouses]) == {
        str(studios): "Студии",
        str(lux): "Люкс",
        str(penthouses): "Пентхаусы",
    }

    db.execute("UPDATE chessboard.layout_groups SET name = 'Студии+' WHERE id = %s", (studios,))
    db.execute("UPDATE chessboard.layout_groups SET sort_order = 7 WHERE id = %s", (lux,))
    db.execute(
        "UPDATE chessboard.layout_groups SET is_archived = true WHERE id = %s", (penthouses,)
    )
    empty = make_layout_group(db, project, "Люкс с видом на море")
    assert queue_row(db, project) is not None  # the raisers enqueued the project
    pipeline()

    assert labels(ch, developer, [studios, lux, penthouses, empty]) == {
        str(studios): "Студии+",
        str(lux): "Люкс",
        str(penthouses): "Пентхаусы",
        str(empty): "Люкс с видом на море",
    }
    current = {g.layout_group_id: g for g in groups(ch, developer)}
    assert current[lux].sort_order == 7
    assert current[penthouses].is_archived
    assert not current[empty].is_archived
    versions = dict(db.execute("SELECT id, version FROM chessboard.layout_groups").fetchall())
    assert {gid: current[gid].source_version for gid in current} == versions

    db.execute("SELECT chessboard.request_project_recalc(%s, %s, 'Crud')", (project, developer))
    drain_until_empty(db, db.info.dsn)
    assert outbox(db) == []  # nothing changed: nothing published


def test_a_restored_project_is_recomputed_and_its_own_fields_are_published(
    db: psycopg.Connection,
) -> None:
    """Tried: a project is archived, its objects change while it is archived (the drain leaves an
    archived project's aggregates alone, by the spec), then it is restored. Before issue 13 the
    restore enqueued nothing and its numbers stayed stale until a child row changed. Now the
    restore (status back, and likewise deleted_at cleared) queues it and the drain recomputes
    it; a rename of the project alone is published as a project event with the new Name. The
    drain's own writes to the project never enqueue it again."""
    project = make_project(db)
    building = make_building(db, project)
    obj = make_object(db, project, building, None, status="Free", price=500)
    drain_until_empty(db, db.info.dsn)

    db.execute("UPDATE chessboard.projects SET status = 'Archived' WHERE id = %s", (project,))
    db.execute(
        "UPDATE chessboard.property_objects SET status = 'Sold', price = 900 WHERE id = %s",
        (obj,),
    )
    drain_until_empty(db, db.info.dsn)  # skipped as archived: aggregates left as they were
    assert drift(db) != {}

    for restore in (
        "UPDATE chessboard.projects SET status = 'Published' WHERE id = %s",
        "UPDATE chessboard.projects SET deleted_at = now() WHERE id = %s",
        "UPDATE chessboard.projects SET deleted_at = NULL WHERE id = %s",
    ):
        db.execute(restore, (project,))
        assert queue_row(db, project) is not None, restore
        drain_until_empty(db, db.info.dsn)
    assert drift(db) == {}
    row = db.execute(
        "SELECT property_objects_free_count, price_min FROM chessboard.projects WHERE id = %s",
        (project,),
    ).fetchone()
    assert row == (0, None)

    db.execute("TRUNCATE chessboard.outbox_events")
    db.execute("UPDATE chessboard.projects SET name = 'ЖК Северный' WHERE id = %s", (project,))
    drain_until_empty(db, db.info.dsn)
    ((topic, key, payload),) = outbox(db)
    assert (topic, key, payload["Name"]) == (PROJECT_TOPIC, str(project), "ЖК Северный")
    version = db.execute("SELECT version FROM chessboard.projects WHERE id = %s", (project,))
    assert payload["Version"] == version.fetchone()[0]
    assert queue_row(db, project) is None  # the drain's writes did not enqueue it again
