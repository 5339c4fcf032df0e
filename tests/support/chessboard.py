"""Writers for tests: rows inserted the way the chessboard API writes them (source fields only)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from uuid import UUID

import psycopg


def make_project(
    conn: psycopg.Connection, *, status: str = "Published", tenant_id: UUID | None = None
) -> UUID:
    project_id = uuid.uuid4()
    conn.execute(
        "INSERT INTO chessboard.projects (id, tenant_id, name, status) VALUES (%s, %s, %s, %s)",
        (project_id, tenant_id or uuid.uuid4(), f"Project {str(project_id)[:8]}", status),
    )
    return project_id


def make_building(conn: psycopg.Connection, project_id: UUID) -> UUID:
    building_id = uuid.uuid4()
    conn.execute(
        "INSERT INTO chessboard.buildings (id, project_id, name) VALUES (%s, %s, 'B')",
        (building_id, project_id),
    )
    return building_id


def make_layout_group(conn: psycopg.Connection, project_id: UUID, name: str = "Студии") -> UUID:
    group_id = uuid.uuid4()
    conn.execute(
        "INSERT INTO chessboard.layout_groups (id, project_id, name) VALUES (%s, %s, %s)",
        (group_id, project_id, name),
    )
    return group_id


def make_layout(
    conn: psycopg.Connection, project_id: UUID, group_id: UUID | None, area: Decimal | float
) -> UUID:
    layout_id = uuid.uuid4()
    conn.execute(
        "INSERT INTO chessboard.layouts (id, project_id, layout_group_id, name, total_area)"
        " VALUES (%s, %s, %s, 'L', %s)",
        (layout_id, project_id, group_id, Decimal(str(area))),
    )
    return layout_id


def make_object(
    conn: psycopg.Connection,
    project_id: UUID,
    building_id: UUID,
    layout_id: UUID | None,
    *,
    status: str = "Free",
    price: Decimal | int = 1000,
) -> UUID:
    object_id = uuid.uuid4()
    conn.execute(
        "INSERT INTO chessboard.property_objects"
        " (id, project_id, building_id, layout_id, status, price)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        (object_id, project_id, building_id, layout_id, status, Decimal(price)),
    )
    return object_id


def make_all_due(conn: psycopg.Connection) -> None:
    """Skip the debounce wait: tests of the drain do not test the clock."""
    conn.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '1 second'"
    )


def small_project(conn: psycopg.Connection) -> dict[str, UUID]:
    """Building, two groups with layouts, and objects of every status (one soft-deleted)."""
    project = make_project(conn)
    building = make_building(conn, project)
    studios = make_layout_group(conn, project, "Студии")
    lux = make_layout_group(conn, project, "Люкс с видом на море")
    small = make_layout(conn, project, studios, Decimal("25.5"))
    make_layout(conn, project, studios, Decimal("31.0"))
    big = make_layout(conn, project, lux, Decimal("120.0"))
    make_object(conn, project, building, small, status="Free", price=1000)
    make_object(conn, project, building, small, status="Free", price=3000)
    make_object(conn, project, building, big, status="Sold", price=9000)
    make_object(conn, project, building, big, status="Hidden", price=5)
    gone = make_object(conn, project, building, small, status="Free", price=10)
    conn.execute("UPDATE chessboard.property_objects SET deleted_at = now() WHERE id = %s", (gone,))
    return {
        "project": project,
        "building": building,
        "studios": studios,
        "lux": lux,
        "small": small,
        "big": big,
    }
