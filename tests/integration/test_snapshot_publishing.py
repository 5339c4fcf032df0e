"""Every change of a published snapshot is published (contract section 4): a layout
group's own fields reach dim_layout_group through drain → relay → loader (a bounded load, and a
running `pin devstats load` read back by `pin devstats labels`), a new group is published once,
a project's and a layout's own fields are published, and a restored project is recomputed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import psycopg

from pin_pipelines.clickhouse import ClickHouse, open_clickhouse
from pin_pipelines.devstats.dim import groups, labels
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.cli import run_pin, summary
from tests.support.loaders import loader_env, loaders, wait_for
from tests.support.recalc import (
    drain_all,
    drain_until_empty,
    failing_on_request,
    outbox,
    queue_row,
)
from tests.support.truth import drift


def _tenant(conn: psycopg.Connection, project: UUID) -> UUID:
    row = conn.execute("SELECT tenant_id FROM chessboard.projects WHERE id = %s", (project,))
    found = row.fetchone()
    assert found is not None
    tenant: UUID = found[0]
    return tenant


def test_group_rename_resort_archive_and_an_empty_group_reach_the_dimension(
    db: psycopg.Connection, ch: ClickHouse, pipeline: Callable[[], None]
) -> None:
    """Tried: three groups with layouts are loaded; then one is renamed, one re-sorted, one
    archived, and a fourth is created without layouts. None of these moves an aggregate, so
    when only aggregate changes were published, nothing was published and the labels kept the old
    names forever. Now the drain publishes each with Version + 1, and after relay and load the
    dimension (labels and groups) shows the new names, order and archive flag, and the empty group.
    A further pipeline run with no change publishes nothing."""
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
    versions = db.execute("SELECT id, version FROM chessboard.layout_groups").fetchall()
    assert {gid: current[gid].source_version for gid in current} == dict(versions)

    db.execute("SELECT chessboard.request_project_recalc(%s, %s, 'Crud')", (project, developer))
    drain_until_empty(db, db.info.dsn)
    assert outbox(db) == []  # nothing changed: nothing published


def test_a_running_loader_shows_the_changed_groups_to_pin_devstats_labels(
    db: psycopg.Connection,
    pipeline: Callable[[], None],
    loader_options: LoadOptions,
    clickhouse_server_url: str,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """The same changes as a user sees them while the loader runs as it now does: one `pin
    devstats load` process (no --once, a consumer group of its own on this test's topic, the
    Debian server, which a `pin devstats labels` process can share). Tried: two groups published
    and shown; then one renamed, one archived and a new one without layouts, drained and
    relayed (the pipeline's own bounded load is another group's and reads another dimension).
    `pin devstats labels --project-id` shows the new names, with no restart of the loader, and
    the archived group reads as archived; SIGTERM ends the loader with everything inserted."""
    project = make_project(db)
    developer = _tenant(db, project)
    building = make_building(db, project)
    studios, lux = make_layout_group(db, project, "Студии"), make_layout_group(db, project, "Люкс")
    for group, area in ((studios, 25), (lux, 120)):
        make_object(db, project, building, make_layout(db, project, group, Decimal(area)))
    continuous = dataclasses.replace(loader_options, group=f"{loader_options.group}-continuous")
    env = loader_env(clickhouse_server_url, kafka_bootstrap, pg_dsn, tmp_path)

    def shown(ids: list[UUID]) -> dict[str, str]:
        args = ["--developer-id", str(developer), "--project-id", str(project)]
        ids_arg = ",".join(map(str, ids))
        return dict(summary(run_pin("devstats", "labels", *args, "--ids", ids_arg, env=env)))

    with loaders(continuous, env, tmp_path) as start:
        loader = start("loader")
        pipeline()
        before = {str(studios): "Студии", str(lux): "Люкс"}
        wait_for("the groups shown", lambda: shown([studios, lux]) == before, 60)

        db.execute("UPDATE chessboard.layout_groups SET name = 'Студии+' WHERE id = %s", (studios,))
        db.execute("UPDATE chessboard.layout_groups SET is_archived = true WHERE id = %s", (lux,))
        empty = make_layout_group(db, project, "Люкс с видом на море")
        pipeline()
        after = {str(studios): "Студии+", str(lux): "Люкс", str(empty): "Люкс с видом на море"}
        wait_for("the changes shown", lambda: shown([studios, lux, empty]) == after, 60)
        report, _ = loader.stop()
    with open_clickhouse(clickhouse_server_url) as ch:
        archived = {g.layout_group_id: g.is_archived for g in groups(ch, developer, project)}
    assert archived == {studios: False, lux: True, empty: False}
    assert (report["inserted"], report["dead_lettered"]) == (5, 0)


def test_a_restored_project_is_queued_and_recomputed(db: psycopg.Connection) -> None:
    """Tried, for both ways a project stops carrying aggregates (status Archived, soft delete):
    retire it, change its object meanwhile (the drain skips a retired project, by the spec, so
    its numbers go stale), then restore it. Without a trigger on the project's own fields the
    restore enqueued nothing and the numbers stayed stale until a child row changed. Now each
    restore queues the project and the drain recomputes it: no drift, the numbers of the object as
    it is now."""
    project = make_project(db)
    building = make_building(db, project)
    obj = make_object(db, project, building, None, status="Free", price=500)
    drain_until_empty(db, db.info.dsn)

    for retire, restore, status, price in (
        ("status = 'Archived'", "status = 'Published'", "Sold", 900),
        ("deleted_at = now()", "deleted_at = NULL", "Free", 700),
    ):
        db.execute(f"UPDATE chessboard.projects SET {retire} WHERE id = %s", (project,))
        db.execute(
            "UPDATE chessboard.property_objects SET status = %s, price = %s WHERE id = %s",
            (status, price, obj),
        )
        drain_until_empty(db, db.info.dsn)  # skipped: aggregates left as they were
        assert drift(db) != {}, retire

        db.execute(f"UPDATE chessboard.projects SET {restore} WHERE id = %s", (project,))
        assert queue_row(db, project) is not None, restore
        drain_until_empty(db, db.info.dsn)
        assert drift(db) == {}, restore
    row = db.execute(
        "SELECT property_objects_free_count, price_min FROM chessboard.projects WHERE id = %s",
        (project,),
    ).fetchone()
    assert row == (1, 700)


def test_own_fields_are_published_and_the_drains_writes_raise_nothing(
    db: psycopg.Connection,
) -> None:
    """Tried: a project, one of its layouts and one of its groups renamed, no aggregate moved.
    The drain publishes one event each with the new Name and Version + 1. It drains them under a
    test trigger that fails any project for which a request is raised while it is drained: the
    drain's own writes (aggregates, version, updated_at, published_snapshot of the project, its
    layouts and groups) raise none, so the project is recalculated, not failed. (Its queue row
    is deleted at the end of the same transaction, so the empty queue alone would not show it.)"""
    project = make_project(db)
    group = make_layout_group(db, project, "Студии")
    layout = make_layout(db, project, group, Decimal(33))
    drain_until_empty(db, db.info.dsn)
    db.execute("TRUNCATE chessboard.outbox_events")

    renamed = {
        (TOPIC_PROJECT, "projects", project): "ЖК Северный",
        (TOPIC_LAYOUT, "layouts", layout): "1К-33",
        (TOPIC_LAYOUT_GROUP, "layout_groups", group): "Студии+",
    }
    for (_, table, key), name in renamed.items():
        db.execute(f"UPDATE chessboard.{table} SET name = %s WHERE id = %s", (name, key))
    assert queue_row(db, project) is not None
    with failing_on_request(db):
        (tick,) = [t for t in drain_all(db.info.dsn, db) if t.results]
    assert [r.outcome for r in tick.results] == ["recalculated"], tick.as_dict()["failures"]
    assert queue_row(db, project) is None

    published = {(topic, key): payload for topic, key, payload in outbox(db)}
    assert published.keys() == {(topic, str(key)) for topic, _, key in renamed}
    for (topic, table, key), name in renamed.items():
        version = db.execute(f"SELECT version FROM chessboard.{table} WHERE id = %s", (key,))
        payload = published[(topic, str(key))]
        assert (payload["Name"], (payload["Version"],)) == (name, version.fetchone())


def test_the_snapshot_builders_are_inlined_into_the_recompute(db: psycopg.Connection) -> None:
    """Tried: EXPLAIN VERBOSE of a query calling each of the three snapshot builders the way
    recalc_claimed_project does. Declared IMMUTABLE around the STABLE jsonb_build_object, they
    were not inlined and ran their body as a query of its own for every row the drain
    recomputes, changed or not (9 % of a steady project's backend CPU, migration 0015); inlined,
    the plan shows jsonb_build_object and not the builder."""
    calls = {
        "project_snapshot": "chessboard.project_snapshot(p, 1, 1, 1.0, 2.0)"
        " FROM chessboard.projects p",
        "layout_snapshot": "chessboard.layout_snapshot(l, 1) FROM chessboard.layouts l",
        "layout_group_snapshot": "chessboard.layout_group_snapshot(g, 1, 1.0, 2.0)"
        " FROM chessboard.layout_groups g",
    }
    for builder, query in calls.items():
        plan = "\n".join(r[0] for r in db.execute(f"EXPLAIN (VERBOSE) SELECT {query}"))
        assert "jsonb_build_object" in plan and builder not in plan, (builder, plan)
