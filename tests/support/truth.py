"""The aggregates recomputed independently of the drain's SQL: raw source rows are read and
count/min/max are taken in Python, then compared with the denormalized columns."""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg

Snapshot = dict[str, dict[UUID, tuple[Any, ...]]]


def _min(values: list[Decimal]) -> Decimal | None:
    return min(values) if values else None


def _max(values: list[Decimal]) -> Decimal | None:
    return max(values) if values else None


def expected_aggregates(conn: psycopg.Connection) -> Snapshot:
    """Spec 000, step 4: free = live and Free; active = live and not Hidden; live layout = not
    soft-deleted; every formula is taken over the project's own rows ("по ProjectId = @p"), so a
    row referencing another project's building/layout/group does not count there. Empty sets
    give NULL bounds and 0 counters."""
    projects = [r[0] for r in conn.execute("SELECT id FROM chessboard.projects")]
    buildings = conn.execute("SELECT id, project_id FROM chessboard.buildings").fetchall()
    groups = conn.execute("SELECT id, project_id FROM chessboard.layout_groups").fetchall()
    layouts = conn.execute(
        "SELECT id, project_id, layout_group_id, total_area, deleted_at FROM chessboard.layouts"
    ).fetchall()
    objects = conn.execute(
        "SELECT id, project_id, building_id, layout_id, status, price, deleted_at"
        " FROM chessboard.property_objects"
    ).fetchall()

    live = [o for o in objects if o[6] is None]
    active = [o for o in live if o[4] != "Hidden"]
    free = [o for o in live if o[4] == "Free"]

    result: Snapshot = {"projects": {}, "buildings": {}, "layouts": {}, "layout_groups": {}}
    for pid in projects:
        prices = [o[5] for o in free if o[1] == pid]
        result["projects"][pid] = (
            _min(prices),
            _max(prices),
            sum(1 for o in active if o[1] == pid),
            len(prices),
        )
    for bid, pid in buildings:
        result["buildings"][bid] = (
            sum(1 for o in active if o[2] == bid and o[1] == pid),
            sum(1 for o in free if o[2] == bid and o[1] == pid),
        )
    for lid, pid, *_ in layouts:
        result["layouts"][lid] = (sum(1 for o in active if o[3] == lid and o[1] == pid),)
    for gid, pid in groups:
        areas = [lay[3] for lay in layouts if lay[2] == gid and lay[1] == pid and lay[4] is None]
        result["layout_groups"][gid] = (len(areas), _min(areas), _max(areas))
    return result


def actual_aggregates(conn: psycopg.Connection) -> Snapshot:
    """The denormalized columns, in the same shape as `expected_aggregates`."""
    return {
        "projects": {
            r[0]: tuple(r[1:])
            for r in conn.execute(
                "SELECT id, price_min, price_max, property_objects_total_count,"
                " property_objects_free_count FROM chessboard.projects"
            )
        },
        "buildings": {
            r[0]: tuple(r[1:])
            for r in conn.execute(
                "SELECT id, property_objects_total_count, property_objects_free_count"
                " FROM chessboard.buildings"
            )
        },
        "layouts": {
            r[0]: tuple(r[1:])
            for r in conn.execute("SELECT id, property_objects_count FROM chessboard.layouts")
        },
        "layout_groups": {
            r[0]: tuple(r[1:])
            for r in conn.execute(
                "SELECT id, layouts_count, area_min, area_max FROM chessboard.layout_groups"
            )
        },
    }


def versions(conn: psycopg.Connection) -> dict[str, dict[UUID, int]]:
    """The monotonic Version of every aggregate row, to see which rows a recalc touched."""
    return {
        table: dict(conn.execute(f"SELECT id, version FROM chessboard.{table}").fetchall())
        for table in ("projects", "buildings", "layouts", "layout_groups")
    }


def drift(conn: psycopg.Connection) -> dict[str, dict[UUID, tuple[Any, Any]]]:
    """Rows whose denormalized values differ from the truth: {table: {id: (actual, expected)}}."""
    expected, actual = expected_aggregates(conn), actual_aggregates(conn)
    return {
        table: {
            key: (actual[table].get(key), value)
            for key, value in rows.items()
            if actual[table].get(key) != value
        }
        for table, rows in expected.items()
        if any(actual[table].get(key) != value for key, value in rows.items())
    }
