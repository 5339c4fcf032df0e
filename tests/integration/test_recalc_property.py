"""Spec 000, "Идемпотентность" SLO: after any sequence of source edits (raw SQL, raisers only)
and drains, every denormalized aggregate equals count/min/max computed independently in Python
from the source rows, and the last published event of each row carries its final values."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from uuid import UUID

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.chessboard import make_building, make_layout, make_layout_group, make_project
from tests.support.database import CHESSBOARD_TABLES
from tests.support.recalc import drain_all, queued_projects
from tests.support.truth import actual_aggregates, drift, expected_aggregates

STATUSES = ["Free", "Booked", "Sold", "Hidden", "Reserved"]
prices = st.decimals(min_value=1, max_value=10**7, places=2, allow_nan=False)
areas = st.decimals(min_value=10, max_value=300, places=1, allow_nan=False)
pick = st.integers(min_value=0, max_value=1_000)  # an index, taken modulo the live choices
maybe_pick = st.none() | pick
project_pick = st.integers(min_value=0, max_value=1)

operations = st.one_of(
    st.tuples(
        st.just("insert_object"), project_pick, pick, maybe_pick, st.sampled_from(STATUSES), prices
    ),
    st.tuples(st.just("set_status"), pick, st.sampled_from(STATUSES)),
    st.tuples(st.just("set_price"), pick, prices),
    st.tuples(st.just("soft_delete_object"), pick),
    st.tuples(st.just("hard_delete_object"), pick),
    st.tuples(st.just("move_object"), pick, project_pick, pick, maybe_pick),
    st.tuples(st.just("bulk_reprice"), project_pick, prices),
    st.tuples(st.just("add_layout"), project_pick, maybe_pick, areas),
    st.tuples(st.just("delete_layout"), pick),
    st.tuples(st.just("soft_delete_layout"), pick),
    st.tuples(st.just("move_layout_to_group"), pick, maybe_pick),
    st.tuples(st.just("set_area"), pick, areas),
    st.tuples(st.just("add_building"), project_pick),
    st.tuples(st.just("add_group"), project_pick),
    st.tuples(
        st.just("drain"),
    ),
)


@dataclass
class World:
    """Ids of the rows the sequence can target, per project (hard-deleted rows removed)."""

    projects: list[UUID]
    buildings: dict[UUID, list[UUID]] = field(default_factory=dict)
    groups: dict[UUID, list[UUID]] = field(default_factory=dict)
    layouts: dict[UUID, list[UUID]] = field(default_factory=dict)
    objects: list[UUID] = field(default_factory=list)

    def all_layouts(self) -> list[UUID]:
        return [lid for p in self.projects for lid in self.layouts[p]]


def _choose(choices: list, index: int | None):
    if index is None or not choices:
        return None
    return choices[index % len(choices)]


def _reset(conn: psycopg.Connection) -> None:
    """The `db` fixture empties the tables once per test; hypothesis runs many examples."""
    conn.execute("TRUNCATE " + ", ".join(f"chessboard.{t}" for t in CHESSBOARD_TABLES) + " CASCADE")


def _project_of_layout(world: World, layout: UUID) -> UUID:
    return next(p for p in world.projects if layout in world.layouts[p])


def _apply(conn: psycopg.Connection, dsn: str, world: World, op: tuple) -> None:
    kind, *args = op
    if kind == "insert_object":
        project_index, building_index, layout_index, status, price = args
        project = world.projects[project_index]
        object_id = uuid.uuid4()
        conn.execute(
            "INSERT INTO chessboard.property_objects (id, project_id, building_id, layout_id,"
            " status, price) VALUES (%s, %s, %s, %s, %s, %s)",
            (
                object_id,
                project,
                _choose(world.buildings[project], building_index),
                _choose(world.layouts[project], layout_index),
                status,
                price,
            ),
        )
        world.objects.append(object_id)
    elif kind in {"set_status", "set_price", "soft_delete_object", "hard_delete_object"}:
        target = _choose(world.objects, args[0])
        if target is None:
            return
        if kind == "set_status":
            sql, params = (
                "UPDATE chessboard.property_objects SET status = %s WHERE id = %s",
                args[1],
            )
        elif kind == "set_price":
            sql, params = "UPDATE chessboard.property_objects SET price = %s WHERE id = %s", args[1]
        elif kind == "soft_delete_object":
            sql, params = (
                "UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %s",
                None,
            )
        else:
            sql, params = "DELETE FROM chessboard.property_objects WHERE id = %s", None
            world.objects.remove(target)
        conn.execute(sql, (target,) if params is None else (params, target))
    elif kind == "move_object":
        object_index, project_index, building_index, layout_index = args
        target = _choose(world.objects, object_index)
        if target is None:
            return
        project = world.projects[project_index]
        conn.execute(
            "UPDATE chessboard.property_objects SET project_id = %s, building_id = %s,"
            " layout_id = %s WHERE id = %s",
            (
                project,
                _choose(world.buildings[project], building_index),
                _choose(world.layouts[project], layout_index),
                target,
            ),
        )
    elif kind == "bulk_reprice":
        project_index, price = args
        conn.execute(
            "UPDATE chessboard.property_objects SET price = %s + (random() * 100)::int"
            " WHERE project_id = %s",
            (price, world.projects[project_index]),
        )
    elif kind == "add_layout":
        project_index, group_index, area = args
        project = world.projects[project_index]
        world.layouts[project].append(
            make_layout(conn, project, _choose(world.groups[project], group_index), area)
        )
    elif kind in {"delete_layout", "soft_delete_layout", "move_layout_to_group", "set_area"}:
        layout = _choose(world.all_layouts(), args[0])
        if layout is None:
            return
        project = _project_of_layout(world, layout)
        if kind == "delete_layout":
            conn.execute("DELETE FROM chessboard.layouts WHERE id = %s", (layout,))
            world.layouts[project].remove(layout)
        elif kind == "soft_delete_layout":
            conn.execute(
                "UPDATE chessboard.layouts SET deleted_at = now() WHERE id = %s", (layout,)
            )
        elif kind == "move_layout_to_group":
            conn.execute(
                "UPDATE chessboard.layouts SET layout_group_id = %s WHERE id = %s",
                (_choose(world.groups[project], args[1]), layout),
            )
        else:
            conn.execute(
                "UPDATE chessboard.layouts SET total_area = %s WHERE id = %s", (args[1], layout)
            )
    elif kind == "add_building":
        project = world.projects[args[0]]
        world.buildings[project].append(make_building(conn, project))
    elif kind == "add_group":
        project = world.projects[args[0]]
        world.groups[project].append(make_layout_group(conn, project, name="G"))
    elif kind == "drain":
        drain_all(dsn, conn)
    else:  # pragma: no cover - the strategy above is the list of kinds
        raise AssertionError(kind)


def _assert_last_events_match(conn: psycopg.Connection) -> None:
    """Consumers upsert by Id: the newest event of each row must equal its final aggregates."""
    last: dict[str, dict] = {}
    for key, payload in conn.execute(
        "SELECT message_key, payload FROM chessboard.outbox_events ORDER BY id"
    ):
        last[key] = payload
    checks = {
        "projects": (
            "SELECT id, version, price_min, price_max, property_objects_total_count,"
            " property_objects_free_count FROM chessboard.projects",
            ("PriceMin", "PriceMax", "PropertyObjectsTotalCount", "PropertyObjectsFreeCount"),
        ),
        "layouts": (
            "SELECT id, version, property_objects_count FROM chessboard.layouts",
            ("PropertyObjectsCount",),
        ),
        "layout_groups": (
            "SELECT id, version, layouts_count, area_min, area_max FROM chessboard.layout_groups",
            ("LayoutsCount", "AreaMin", "AreaMax"),
        ),
    }
    for table, (sql, fields) in checks.items():
        for row_id, version, *values in conn.execute(sql):
            if version == 1:
                assert str(row_id) not in last, f"{table} {row_id}: event without a change"
                continue
            payload = last[str(row_id)]
            assert payload["Version"] == version, table
            published = [None if payload[f] is None else Decimal(str(payload[f])) for f in fields]
            assert published == values, (table, row_id)


object_rows = st.tuples(project_pick, pick, maybe_pick, st.sampled_from(STATUSES), prices)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    initial=st.lists(object_rows, min_size=1, max_size=12),
    ops=st.lists(operations, min_size=1, max_size=25),
)
def test_random_edits_then_drain_leave_every_aggregate_equal_to_the_truth(db, pg_dsn, initial, ops):
    """Two projects (two buildings, two groups, three layouts each) with random objects, then a
    random sequence of raw SQL edits: objects inserted with random status/price, status and
    price changes, soft and hard deletes, moves to another layout/building/project, bulk
    reprices; layouts added, deleted, soft-deleted, moved between groups and resized; buildings
    and groups added; drains at random points. After a final drain the queue is empty, every
    aggregate of projects, buildings, layouts and layout groups equals count/min/max computed
    in Python, and each row's newest event carries those values with its version."""
    _reset(db)
    world = World(projects=[make_project(db), make_project(db)])
    for project in world.projects:
        world.buildings[project] = [make_building(db, project) for _ in range(2)]
        world.groups[project] = [make_layout_group(db, project) for _ in range(2)]
        world.layouts[project] = [
            make_layout(db, project, world.groups[project][0], 35),
            make_layout(db, project, world.groups[project][1], 60),
            make_layout(db, project, None, 80),
        ]
    for row in initial:
        _apply(db, pg_dsn, world, ("insert_object", *row))

    for op in ops:
        _apply(db, pg_dsn, world, op)
    drain_all(pg_dsn, db)

    assert queued_projects(db) == {}
    assert drift(db) == {}
    assert actual_aggregates(db) == expected_aggregates(db)
    _assert_last_events_match(db)
