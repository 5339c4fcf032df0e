"""The bulk build of a catalogue (bench/sql/bench_scale.sql) and its consistency checks: the
seeding phase."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import psycopg
from _common import log
from psycopg import sql

from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.reconcile import aggregates_drift

from .catalogue import Shape, by_class
from .databases import Q


@contextmanager
def indexes_rebuilt(
    conn: psycopg.Connection, table: str, timings: dict[str, float]
) -> Iterator[None]:
    """Drops `table`'s indexes (primary key included) for the body, then builds them again from
    their catalogue definitions and checks they came back identical. Only for a table that no
    foreign key references (the drop would fail otherwise)."""
    before = list(Q.index_definitions(conn, table_name=table))
    schema, name = table.split(".")
    for index_name, constraint, _ in before:
        if constraint:
            conn.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    sql.Identifier(schema, name), sql.Identifier(constraint)
                )
            )
        else:
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.SQL(index_name)))
    yield
    started = time.perf_counter()
    for _, constraint, definition in before:
        if constraint:
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                    sql.Identifier(schema, name), sql.Identifier(constraint), sql.SQL(definition)
                )
            )
        else:
            conn.execute(sql.SQL(definition))
    timings["index_builds"] = round(time.perf_counter() - started, 1)
    after = list(Q.index_definitions(conn, table_name=table))
    assert before and after == before, f"{table}: indexes differ after the rebuild"


def build_catalogue(dsn: str, shape: Shape) -> tuple[dict[str, Any], dict[UUID, int]]:
    """Writes `shape` into the empty migrated database at `dsn` in one transaction (see
    bench/sql/bench_scale.sql), then vacuums, analyzes and checkpoints it. Returns the
    timings and each project's object count."""
    timings: dict[str, Any] = {}
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        # Raisers, foreign-key triggers and the groups' developer triggers stay quiet here.
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET work_mem = '512MB'")
        conn.execute("SET maintenance_work_mem = '1GB'")

        def step(name: str, run: Callable[[], object]) -> None:
            t0 = time.perf_counter()
            run()
            timings[name] = round(time.perf_counter() - t0, 1)

        step(
            "plan",
            lambda: (
                Q.plan_projects(
                    conn,
                    sizes=list(shape.sizes),
                    counts=list(shape.counts),
                    filler_projects=shape.filler_projects,
                    filler_objects=shape.filler_objects,
                ),
                Q.plan_buildings(conn),
                Q.plan_layout_groups(conn),
                Q.plan_layouts(conn),
                Q.plan_references(conn),
            ),
        )
        with indexes_rebuilt(conn, "chessboard.property_objects", timings):
            step("property_objects", lambda: Q.insert_property_objects(conn))
        step("aggregates", lambda: Q.aggregate_objects(conn))
        step(
            "hierarchy",
            lambda: (
                Q.insert_projects(conn),
                Q.insert_buildings(conn),
                Q.insert_layout_groups(conn),
                Q.insert_layouts(conn),
            ),
        )
        step(
            "snapshots",
            lambda: (
                Q.publish_project_snapshots(conn),
                Q.publish_layout_snapshots(conn),
                Q.publish_layout_group_snapshots(conn),
            ),
        )
        sizes = {row[0]: int(row[1]) for row in conn.execute("SELECT id, size FROM bench_plan")}
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        step("vacuum_analyze", lambda: conn.execute("VACUUM (ANALYZE)"))
        # The load's gigabytes of dirty pages written now, not by the checkpointer during the
        # first measures (needs superuser or pg_checkpoint, as the session_replication_role).
        step("checkpoint", lambda: conn.execute("CHECKPOINT"))
        database_bytes = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    timings["total"] = round(time.perf_counter() - started, 1)
    return {"seconds": timings, "database_mb": (database_bytes or [0])[0] // 2**20}, sizes


def consistency(dsn: str, classes: dict[int, list[UUID]]) -> dict[str, Any]:
    """The built catalogue is what the drain keeps: the reconciliation finds no drift, and
    projects of every class forced due without a change are recomputed without writing a row or
    publishing anything."""
    started = time.perf_counter()
    drift = aggregates_drift(dsn)
    drift_seconds = time.perf_counter() - started
    if drift.project_ids:
        raise SystemExit(f"the built catalogue drifts: {drift.summary()}")
    ids = [p for members in classes.values() for p in members[:50]]
    with psycopg.connect(dsn, autocommit=True) as conn:
        Q.force_due(conn, project_ids=ids)
    tick = drain_tick(dsn, batch_size=len(ids))
    written = sum(sum(r.republished.values()) + r.buildings_updated for r in tick.results)
    recalculated = tick.count("recalculated")
    if written or recalculated != len(ids):
        raise SystemExit(
            f"the built catalogue is not what the drain keeps: {written} rows written by a drain"
            f" of {len(ids)} unchanged projects ({recalculated} recalculated)"
        )
    return {
        "drift_check_seconds": round(drift_seconds, 1),
        "projects_drifted": 0,
        "drained_unchanged_projects": len(ids),
        "rows_written": written,
    }


def build_catalogues(
    dsns: dict[str, str], shapes: dict[str, Shape]
) -> tuple[dict[str, dict[int, list[UUID]]], dict[str, dict[str, Any]]]:
    """Each database of `dsns` built to its shape and checked, in turn: the projects by size
    class of each, and the report of each (its build and consistency)."""
    classes: dict[str, dict[int, list[UUID]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for label, dsn in dsns.items():
        log("build", database=label, **shapes[label].as_dict())
        built, sizes = build_catalogue(dsn, shapes[label])
        classes[label] = by_class(shapes[label], sizes)
        reports[label] = {"build": built, "consistency": consistency(dsn, classes[label])}
        log("built", database=label, **built)
    return classes, reports
