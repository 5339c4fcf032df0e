"""Recalc benchmark (issue 3): per-project recompute latency by size, drain throughput with 1 and 2
workers against pgbench running the same SQL statements. Prints ONE JSON line.

    .venv/bin/python bench/bench_recalc.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import drain_all, drain_throughput, fresh_database, quantiles

from pin_pipelines.config import SQL_DIR
from pin_pipelines.db import queries
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.stack.postgres import bindir


def insert_projects(dsn: str, projects: int, objects: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = queries("bench").insert_bench_projects(
            conn,
            projects=projects,
            buildings=max(1, min(20, objects // 500)),
            layouts=max(5, min(100, objects // 100)),
            objects=objects,
        )
        ids = [str(r[0]) for r in rows]
        conn.execute("ANALYZE")
    return ids


def make_due(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO chessboard.project_recalc_requests AS r"
            " (project_id, tenant_id, due_at, first_requested_at, last_reason)"
            " SELECT id, tenant_id, now(), now(), 'Manual' FROM chessboard.projects"
            " ON CONFLICT (project_id) DO UPDATE SET due_at = now()"
        )


def latency(dsn: str, sizes: list[int], reps: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for size in sizes:
        (project_id,) = insert_projects(dsn, 1, size)
        make_due(dsn)
        drain_all(dsn)
        durations = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            object_id = conn.execute(
                "SELECT id FROM chessboard.property_objects WHERE project_id = %s LIMIT 1",
                (project_id,),
            ).fetchone()[0]  # type: ignore[index]
            for _ in range(reps):
                # A real change every time: the recompute updates rows and writes events.
                conn.execute(
                    "UPDATE chessboard.property_objects SET status = CASE status WHEN 'Free'"
                    " THEN 'Booked' ELSE 'Free' END WHERE id = %s",
                    (object_id,),
                )
                conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
                tick = drain_tick(dsn, batch_size=1)
                durations.append(tick.results[0].duration_seconds)
        out[str(size)] = quantiles(durations)
    return out


def pgbench_script() -> str:
    """The drain's statements for one project, from the named-query file, as a pgbench script."""
    text = (SQL_DIR / "postgres" / "queries" / "recalc.sql").read_text()
    blocks = dict(re.findall(r"-- name: (\w+)\([^)]*\)[$^!]?\n(.*?)(?=\n-- name:|\Z)", text, re.S))

    def body(name: str) -> str:
        lines = [ln for ln in blocks[name].splitlines() if not ln.lstrip().startswith("--")]
        return "\n".join(lines).strip()

    # The claim commits on its own (drain.py), then the work transaction locks the row again.
    claim = [
        "BEGIN;",
        body("relax_commit_durability"),
        body("claim_due_request").rstrip(";") + " \\gset",
        "COMMIT;",
        "BEGIN;",
    ]
    steps = [
        body(n)
        for n in (
            "lock_claimed_request",
            "lock_project",
            "recalc_buildings",
            "recalc_layouts",
            "recalc_layout_groups",
            "recalc_project",
            "delete_request",
        )
    ]
    return "\n".join([*claim, *steps, "COMMIT;"]) + "\n"


def pgbench_throughput(dsn: str, clients: int, projects: int) -> float:
    make_due(dsn)
    parts = urlsplit(dsn)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(pgbench_script())
    pgbench = (
        str(bindir() / "pgbench") if (bindir() / "pgbench").exists() else shutil.which("pgbench")
    )
    argv = [
        str(pgbench),
        "-n",
        "-M",
        "extended",
        "-f",
        f.name,
        "-c",
        str(clients),
        "-j",
        str(clients),
        "-t",
        str(projects // clients),
        "-h",
        parts.hostname or "127.0.0.1",
        "-p",
        str(parts.port or 5432),
        "-U",
        parts.username or "postgres",
        parts.path.lstrip("/"),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    sizes = [100, 1000] if args.quick else [100, 1_000, 10_000, 50_000]
    reps = 10 if args.quick else 50
    dsn = fresh_database("pin_bench_recalc")
    lat = latency(dsn, sizes, reps)

    projects = 300 if args.quick else 2000
    dsn = fresh_database("pin_bench_recalc")
    insert_projects(dsn, projects, 50)
    make_due(dsn)
    drain_all(dsn)  # first pass writes everything; the measured passes are steady state
    make_due(dsn)
    one = drain_throughput(dsn, 1)
    make_due(dsn)
    two = drain_throughput(dsn, 2)
    pg1 = pgbench_throughput(dsn, 1, projects)
    pg2 = pgbench_throughput(dsn, 2, projects)
    print(
        json.dumps(
            {
                "bench": "recalc",
                "recompute_latency_by_objects": lat,
                "drain_projects_per_s": {"workers_1": round(one, 1), "workers_2": round(two, 1)},
                "pgbench_projects_per_s": {"clients_1": round(pg1, 1), "clients_2": round(pg2, 1)},
                "ratio_vs_pgbench": {
                    "workers_1": round(one / pg1, 3),
                    "workers_2": round(two / pg2, 3),
                },
                "projects": projects,
                "objects_per_project": 50,
            }
        )
    )


if __name__ == "__main__":
    main()
