"""bench/bench_scale.py at a tiny size (issue 18): CI runs its new code paths that need only
PostgreSQL (the bulk catalogue build, its consistency checks, the per-size recompute, drain and
CPU measures); the sizes that matter run by hand (README, docs/capacity.md). No figure is
asserted: the machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg

from pin_pipelines.config import SOURCE_ROOT, dsn_with_dbname

SIZES = {"500", "100", "10", "1", "115"}


def test_bench_scale_runs_at_a_tiny_size(pg_dsn: str) -> None:
    """Tried: the benchmark without Kafka and `pin serve` on 60 projects / 6,000 objects in five
    size classes, and a 30-project baseline. The script exits non-zero when a built catalogue
    drifts from its objects or when a drain of unchanged projects writes anything, so exit 0
    says the set-based build (triggers off, indexes rebuilt) leaves what the drain keeps."""
    database = f"{pg_dsn.rsplit('/', 1)[1]}_scale"
    done = subprocess.run(
        [
            sys.executable,
            str(SOURCE_ROOT / "bench" / "bench_scale.py"),
            *("--projects", "60", "--objects", "6000", "--largest", "500"),
            *("--baseline-projects", "30", "--samples", "3", "--distinct", "2", "--rounds", "1"),
            *("--no-events", "--e2e-minutes", "0", "--database", database),
        ],
        env={**os.environ, "PIN_PG_DSN": pg_dsn},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    large, baseline = result["catalogues"]["large"], result["catalogues"]["baseline"]
    assert (large["projects"], large["property_objects"]) == (60, 6000)
    assert large["projects_by_size"] == {"500": 3, "100": 3, "10": 3, "1": 15, "115-116": 36}
    assert baseline["projects_by_size"] == {"500": 3, "100": 3, "10": 3, "1": 8, "115-116": 13}
    for catalogue in (large, baseline):
        assert catalogue["consistency"]["projects_drifted"] == 0
        assert catalogue["consistency"]["rows_written"] == 0
        assert catalogue["consistency"]["drained_unchanged_projects"] == catalogue["projects"]

    latency = result["recompute_latency_by_size"]
    assert set(latency) == SIZES
    for row in latency.values():
        assert row["large"]["n"] == row["baseline"]["n"] == 3
    assert result["drain_throughput"]["projects"] == 30  # the baseline's mix in both databases
    cpu = result["recompute_cpu_by_size"]
    assert set(cpu) == SIZES
    for row in cpu.values():  # measured in both catalogues (a few ms: the ratio may be None)
        assert row["large"]["projects"] > 0 and row["baseline"]["projects"] > 0
        assert "ratio" in row

    with psycopg.connect(dsn_with_dbname(pg_dsn, "postgres")) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"{database}%",)
        ).fetchall()
    assert left == [], "the benchmark's databases are dropped at its end"
