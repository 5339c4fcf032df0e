"""End-to-end lag (issue 3): a committed object change → the project's aggregates updated, with
`pin serve` (Dagster daemon + sensor) running and the spec's 30 s debounce. Prints ONE JSON line.

    .venv/bin/python bench/bench_e2e_lag.py [--changes 20] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fresh_database, quantiles

from pin_pipelines.db import queries


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between changes")
    parser.add_argument("--port", type=int, default=3117)
    args = parser.parse_args()

    dsn = fresh_database("pin_bench_e2e")
    with psycopg.connect(dsn, autocommit=True) as conn:
        projects = [
            r[0]
            for r in queries("bench").insert_bench_projects(
                conn, projects=args.changes, buildings=2, layouts=10, objects=200
            )
        ]
        # The initial load is not what we measure: settle it before the daemon starts.
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pin_pipelines.cli",
            "recalc",
            "drain",
            "--once",
            "--batch-size",
            "1000",
        ],
        env={**os.environ, "PIN_PG_DSN": dsn},
        check=True,
        capture_output=True,
    )

    home = tempfile.mkdtemp(prefix="pin-bench-dagster-")
    env = {
        **os.environ,
        "PIN_PG_DSN": dsn,
        "DAGSTER_HOME": home,
        "PIN_DAGSTER_PORT": str(args.port),
    }
    serve = subprocess.Popen(
        [sys.executable, "-m", "pin_pipelines.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(15)  # daemon and code server start-up
        committed: dict[object, float] = {}
        lags: dict[object, float] = {}
        random.shuffle(projects)
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.time() + args.changes * args.every + 120
            while time.time() < deadline and len(lags) < args.changes:
                if len(committed) < args.changes and (
                    not committed or time.time() - max(committed.values()) >= args.every
                ):
                    project = projects[len(committed)]
                    conn.execute(
                        "UPDATE chessboard.property_objects SET price = price + 1 WHERE id ="
                        " (SELECT id FROM chessboard.property_objects WHERE project_id = %s"
                        " AND status = 'Free' LIMIT 1)",
                        (project,),
                    )
                    committed[project] = time.time()
                pending = [p for p in committed if p not in lags]
                if pending:
                    rows = conn.execute(
                        "SELECT id, extract(epoch FROM updated_at) FROM chessboard.projects"
                        " WHERE id = ANY(%s)",
                        (pending,),
                    ).fetchall()
                    for project, updated in rows:
                        if float(updated) > committed[project]:
                            lags[project] = float(updated) - committed[project]
                time.sleep(0.2)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    print(
        json.dumps(
            {
                "bench": "e2e_lag",
                "debounce_s": 30,
                "changes": args.changes,
                "observed": len(lags),
                "lag_seconds": {
                    k.replace("_ms", "_s"): round(v / 1000, 2)
                    for k, v in quantiles(list(lags.values())).items()
                    if k != "n"
                }
                if lags
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
