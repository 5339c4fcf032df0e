"""bench/bench_scale.py at a tiny size: CI runs its new code paths that need only
PostgreSQL (the bulk catalogue build, its consistency checks, the per-size recompute, drain and
CPU measures); the sizes that matter run by hand (docs/benchmarks.md, docs/capacity.md). No figure
is compared with a goal: the machine is shared; the report is checked whole instead (every row and
field, numbers that can be, ratios that are the ratios of their rows)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import psycopg

from pin_pipelines.config import SOURCE_ROOT, dsn_with_dbname
from tests.support.pg import dbname

SIZES = {"500", "100", "10", "1", "115"}
#: Projects per size class (the filler class is "115"), as the catalogues' projects_by_size say.
CLASS_PROJECTS = {
    "large": {"500": 3, "100": 3, "10": 3, "1": 15, "115": 36},
    "baseline": {"500": 3, "100": 3, "10": 3, "1": 8, "115": 13},
}
BUILD_STEPS = {
    "plan",
    "property_objects",
    "index_builds",
    "aggregates",
    "hierarchy",
    "snapshots",
    "vacuum_analyze",
    "checkpoint",
    "total",
}
LATENCY_FIELDS = {
    "n",
    "p50_ms",
    "p99_ms",
    "mean_ms",
    "projects",
    "first_touch_p50_ms",
    "first_touch_max_ms",
}
CPU_FIELDS = {
    "projects",
    "cpu_ms_per_project",
    "postgres_ms_per_project",
    "worker_ms_per_project",
    "projects_per_s",
}
#: A statement of the drain is cancelled after 10 s: no recompute is slower.
MAX_MS = 10_000


def _number(value: Any) -> bool:
    """A finite JSON number (not a bool, not a string, not NaN or infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _progress(stderr: str) -> list[dict[str, Any]]:
    """The bench's progress lines on stderr (`log`: a JSON object with t and msg)."""
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith('{"t": ')]
    assert all(line.keys() >= {"t", "msg"} for line in lines), lines
    return lines


def _assert_report(result: dict[str, Any], stderr: str) -> None:
    """The report of the tiny run below, whole: each section with exactly its rows and fields,
    the numbers finite and in range, each ratio the ratio of its row and each verdict its
    ratio's, the CPU batches the whole class; the stderr progress lines say the same."""
    assert set(result) == {
        "bench",
        "machine",
        "catalogues",
        "recompute_latency_by_size",
        "drain_throughput",
        "recompute_cpu_by_size",
    }  # --no-events, --e2e-minutes 0, no --soak: no such sections
    assert result["bench"] == "scale"
    machine = result["machine"]
    assert set(machine) == {"cpus", "load_average_start", "load_average_end"}
    assert isinstance(machine["cpus"], int) and machine["cpus"] >= 1
    for loads in (machine["load_average_start"], machine["load_average_end"]):
        assert len(loads) == 3 and all(_number(x) and x >= 0 for x in loads), loads

    assert set(result["catalogues"]) == {"large", "baseline"}
    large, baseline = result["catalogues"]["large"], result["catalogues"]["baseline"]
    assert (large["projects"], large["property_objects"]) == (60, 6000)
    assert large["projects_by_size"] == {"500": 3, "100": 3, "10": 3, "1": 15, "115-116": 36}
    # The same classes: 1,838 objects in the tiers, 13 filler projects of 115.
    assert (baseline["projects"], baseline["property_objects"]) == (30, 3333)
    assert baseline["projects_by_size"] == {"500": 3, "100": 3, "10": 3, "1": 8, "115-116": 13}
    for catalogue in (large, baseline):
        assert set(catalogue) == {
            "projects",
            "property_objects",
            "projects_by_size",
            "build",
            "consistency",
        }
        assert set(catalogue["build"]) == {"seconds", "database_mb"}
        seconds = catalogue["build"]["seconds"]
        assert set(seconds) == BUILD_STEPS
        assert all(_number(v) and 0 <= v <= seconds["total"] for v in seconds.values()), seconds
        assert isinstance(catalogue["build"]["database_mb"], int)
        assert catalogue["build"]["database_mb"] > 0
        assert catalogue["consistency"] == {
            "drift_check_seconds": catalogue["consistency"]["drift_check_seconds"],
            "projects_drifted": 0,
            "drained_unchanged_projects": catalogue["projects"],
            "rows_written": 0,
        }
        assert _number(catalogue["consistency"]["drift_check_seconds"])
        assert catalogue["consistency"]["drift_check_seconds"] >= 0

    latency = result["recompute_latency_by_size"]
    assert set(latency) == SIZES
    for size, row in latency.items():
        assert set(row) == {"large", "baseline", "ratio_p50", "ratio_p99", "ok"}, size
        for label in ("large", "baseline"):
            side = row[label]
            assert set(side) == LATENCY_FIELDS, (size, label)
            assert (side["n"], side["projects"]) == (3, 2), (size, label)  # --samples, --distinct
            assert all(_number(side[k]) for k in LATENCY_FIELDS), (size, side)
            assert 0 < side["p50_ms"] <= side["p99_ms"] < MAX_MS, (size, side)
            assert 0 < side["mean_ms"] <= side["p99_ms"], (size, side)  # p99 of 3 is the max
            assert 0 < side["first_touch_p50_ms"] <= side["first_touch_max_ms"] < MAX_MS
        for q in ("p50", "p99"):
            expected = round(row["large"][f"{q}_ms"] / row["baseline"][f"{q}_ms"], 2)
            assert row[f"ratio_{q}"] == expected, (size, row)
        assert row["ok"] is (max(row["ratio_p50"], row["ratio_p99"]) <= 1.5), (size, row)

    throughput = result["drain_throughput"]
    assert set(throughput) == {"projects", "rounds", "workers_1", "workers_2"}
    # The baseline's mix in both databases, one round (--rounds 1).
    assert (throughput["projects"], throughput["rounds"]) == (30, 1)
    for workers in ("workers_1", "workers_2"):
        rates = throughput[workers]
        assert set(rates) == {"large_projects_per_s", "baseline_projects_per_s", "ratio"}
        assert all(_number(v) and v > 0 for v in rates.values()), (workers, rates)
        # The ratio of the unrounded rates (each reported to 0.1), itself to 0.01.
        large_rate, base_rate = rates["large_projects_per_s"], rates["baseline_projects_per_s"]
        low = (large_rate - 0.05) / (base_rate + 0.05) - 0.005
        high = (large_rate + 0.05) / max(base_rate - 0.05, 1e-9) + 0.005
        assert low <= rates["ratio"] <= high, (workers, rates)

    cpu = result["recompute_cpu_by_size"]
    assert set(cpu) == SIZES
    for size, row in cpu.items():  # measured in both catalogues (a few ms: the ratio may be None)
        assert set(row) == {"large", "baseline", "ratio"}, size
        for label in ("large", "baseline"):
            side = row[label]
            assert set(side) == CPU_FIELDS, (size, label)
            # Up to 2,000 projects of the class (at least 10 when it has them): here all of it.
            assert side["projects"] == CLASS_PROJECTS[label][size], (size, label)
            assert all(_number(side[k]) and side[k] >= 0 for k in CPU_FIELDS), (size, side)
            assert side["projects_per_s"] > 0, (size, side)
            assert side["cpu_ms_per_project"] < 1000, (size, side)  # a recompute is milliseconds
            # The total is the worker's and its backends' (each rounded apart), plus whatever
            # else the meter counts (an autovacuum worker of the database).
            parts = side["postgres_ms_per_project"] + side["worker_ms_per_project"]
            assert parts <= side["cpu_ms_per_project"] + 0.02, (size, side)
        base = row["baseline"]["cpu_ms_per_project"]
        expected = round(row["large"]["cpu_ms_per_project"] / base, 2) if base else None
        assert row["ratio"] == expected, (size, row)

    # The progress lines on stderr say what the report says.
    progress = _progress(stderr)
    assert [(p["msg"], p.get("database")) for p in progress] == [
        ("build", "baseline"),
        ("built", "baseline"),
        ("build", "large"),
        ("built", "large"),
        *(("latency", None) for _ in SIZES),
        ("throughput", None),
        ("cpu per project", None),
    ]
    for p in progress[:4]:
        catalogue = result["catalogues"][p["database"]]
        fields = {k: v for k, v in p.items() if k not in {"t", "msg", "database"}}
        if p["msg"] == "build":
            assert fields == {
                k: catalogue[k] for k in ("projects", "property_objects", "projects_by_size")
            }
        else:
            assert fields == catalogue["build"]
    assert {
        str(p["size"]): (p["ratio_p50"], p["ratio_p99"]) for p in progress if p["msg"] == "latency"
    } == {size: (row["ratio_p50"], row["ratio_p99"]) for size, row in latency.items()}
    assert progress[-2]["projects"] == throughput["projects"]


def test_bench_scale_runs_at_a_tiny_size(pg_dsn: str) -> None:
    """Tried: the benchmark without Kafka and `pin serve` on 60 projects / 6,000 objects in five
    size classes, and a 30-project baseline. The script exits non-zero when a built catalogue
    drifts from its objects or when a drain of unchanged projects writes anything, so exit 0
    says the set-based build (triggers off, indexes rebuilt) leaves what the drain keeps. Its
    one stdout line, the report, is checked whole (_assert_report), and its databases are gone."""
    database = f"{dbname(pg_dsn)}_scale"
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
    _assert_report(result, done.stderr)

    with psycopg.connect(dsn_with_dbname(pg_dsn, "postgres")) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"{database}%",)
        ).fetchall()
    assert left == [], "the benchmark's databases are dropped at its end"
