"""Aggregate drift check at scale; not a test. Prints ONE JSON line.

Builds its own database (default `pin_bench_reconcile` next to PIN_PG_DSN; dropped and created):
10,000 projects × (2 buildings, 3 layout groups, 15 layouts, 100 property objects) = 1,000,000
property objects, written in bulk through the writers' path (the raisers enqueue every project).
Then times `aggregates_drift` twice: right after the load, when every project is drifted (the
worst case: every stored counter is still 0), and after the drain made the database consistent
(the normal case: a full scan that finds nothing). Goal: < 60 s each.

Usage: .venv/bin/python bench/bench_reconcile.py [--projects 10000] [--objects-per-project 100]
       [--no-drain]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pin_pipelines.config import DEFAULT_PG_DSN, dsn_with_dbname
from pin_pipelines.db import connect
from pin_pipelines.migrate import migrate_postgres
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.reconcile import aggregates_drift

GOAL_SECONDS = 60.0

# Bulk writers of the benchmark data set; statuses and prices vary so every predicate matters.
LOAD = [
    """CREATE TEMP TABLE bp AS
       SELECT gen_random_uuid() AS id, i FROM generate_series(1, %(projects)s) i""",
    """INSERT INTO chessboard.projects (id, tenant_id, name, status)
       SELECT id, gen_random_uuid(), 'Bench ' || i,
              (ARRAY['Draft', 'Published', 'Hidden'])[1 + i %% 3]
       FROM bp""",
    """CREATE TEMP TABLE bb AS
       SELECT gen_random_uuid() AS id, bp.id AS project_id, n FROM bp, generate_series(0, 1) n""",
    """INSERT INTO chessboard.buildings (id, project_id, name)
       SELECT id, project_id, 'B' || n FROM bb""",
    """CREATE TEMP TABLE bg AS
       SELECT gen_random_uuid() AS id, bp.id AS project_id, n FROM bp, generate_series(0, 2) n""",
    """INSERT INTO chessboard.layout_groups (id, project_id, name, sort_order)
       SELECT id, project_id, 'G' || n, n FROM bg""",
    """CREATE TEMP TABLE bl AS
       SELECT gen_random_uuid() AS id, bp.id AS project_id, n FROM bp, generate_series(0, 14) n""",
    """INSERT INTO chessboard.layouts
           (id, project_id, layout_group_id, name, total_area, deleted_at)
       SELECT bl.id, bl.project_id, bg.id, 'L' || bl.n, 20 + (bl.n * 7.5),
              CASE WHEN bl.n = 14 THEN now() END
       FROM bl JOIN bg ON bg.project_id = bl.project_id AND bg.n = bl.n %% 3""",
    """INSERT INTO chessboard.property_objects
           (id, project_id, building_id, layout_id, status, price, deleted_at)
       SELECT gen_random_uuid(), bp.id, bb.id, bl.id,
              (ARRAY['Free', 'Free', 'Booked', 'Sold', 'Hidden'])[1 + (k + bp.i) %% 5],
              1000000 + ((k * 7919 + bp.i * 104729) %% 20000000),
              CASE WHEN k %% 37 = 0 THEN now() END
       FROM bp
       CROSS JOIN generate_series(0, %(objects)s - 1) k
       JOIN bb ON bb.project_id = bp.id AND bb.n = k %% 2
       JOIN bl ON bl.project_id = bp.id AND bl.n = k %% 15""",
]


def timed_check(dsn: str) -> dict[str, float | int]:
    started = time.perf_counter()
    drift = aggregates_drift(dsn)
    seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 3),
        "projects_checked": drift.checked["project"],
        "projects_drifted": len(drift.project_ids),
        "drifted_cells": len(drift.rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--projects", type=int, default=10_000)
    parser.add_argument("--objects-per-project", type=int, default=100)
    parser.add_argument("--no-drain", action="store_true")
    parser.add_argument(
        "--dsn",
        default=dsn_with_dbname(
            os.environ.get("PIN_PG_DSN") or DEFAULT_PG_DSN, "pin_bench_reconcile"
        ),
    )
    args = parser.parse_args()
    dbname = args.dsn.rsplit("/", 1)[1]
    with connect(dsn_with_dbname(args.dsn, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{dbname}"')
    migrate_postgres(args.dsn)

    started = time.perf_counter()
    with connect(args.dsn, autocommit=True) as conn:
        with conn.transaction():
            for statement in LOAD:
                conn.execute(
                    statement, {"projects": args.projects, "objects": args.objects_per_project}
                )
        conn.execute("VACUUM ANALYZE")
        objects = conn.execute("SELECT count(*) FROM chessboard.property_objects").fetchone()
    load_seconds = time.perf_counter() - started

    result: dict[str, object] = {
        "bench": "reconcile_aggregates",
        "projects": args.projects,
        "property_objects": objects[0] if objects else 0,
        "load_seconds": round(load_seconds, 1),
        "all_drifted": timed_check(args.dsn),
    }
    if not args.no_drain:
        started = time.perf_counter()
        with connect(args.dsn, autocommit=True) as conn:
            while True:
                conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
                if not drain_tick(args.dsn, batch_size=1000).results:
                    break
            conn.execute("VACUUM ANALYZE")
        result["drain_seconds"] = round(time.perf_counter() - started, 1)
        result["consistent"] = timed_check(args.dsn)
    checks = [v for k, v in result.items() if k in ("all_drifted", "consistent")]
    worst = max(float(c["seconds"]) for c in checks if isinstance(c, dict))
    result.update(
        {"max_check_seconds": worst, "goal_seconds": GOAL_SECONDS, "ok": worst < GOAL_SECONDS}
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
