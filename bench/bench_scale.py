"""Scale benchmark and soak (issue 18); not a test. Prints ONE JSON line (progress on stderr).

Builds a skewed catalogue (default 100,000 projects / 10,000,000 property objects: a few projects
of 50,000 objects, most of about 35) and a 1,000-project baseline with the same size classes, each
in a database of its own, then measures both in the same run:

- recompute p50/p99 per project size (goal: the large database within 1.5x of the baseline);
- drain throughput with 1 and 2 workers on the same mix of projects;
- CPU-seconds per recalculated project by size, per relayed and per loaded event (`pin outbox
  relay --once`, `pin devstats load --once` on a private Kafka broker and embedded ClickHouse);
- `pin reconcile` over the whole catalogue (goal: < 60 s at 10M objects);
- E2E lag under `pin serve` (private Dagster home, storage database and port) at a sustained
  edit rate;
- with --soak MINUTES: the same load on the large catalogue for that long, sampled every minute
  (queue, outbox and counter tables with their indexes, dead tuples, drain throughput).

    .venv/bin/python bench/bench_scale.py [--projects 100000] [--objects 10000000]
        [--baseline-projects 1000] [--edit-rate 20] [--e2e-minutes 5] [--soak 30]
        [--only-soak]

The databases (--database, default pin_bench_scale, and its *_baseline / *_dagster siblings on
the PIN_PG_DSN server) are dropped at the end; the broker and the Dagster processes are stopped
and waited for. The PIN_PG_DSN role must be a superuser: the loader turns the raisers off with
session_replication_role and checkpoints after the load. CPU figures need the server on this
machine (bench/_cpu.py reads /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BASE_DSN,
    bench_queries,
    drain_throughput,
    fresh_database,
    quantiles,
    seconds_quantiles,
)
from _cpu import CpuMeter, postmaster_pid

from pin_pipelines.config import Settings, dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import ensure_topics
from pin_pipelines.recalc.drain import drain_tick
from pin_pipelines.reconcile import aggregates_drift
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import free_port, port_open

Q: Any = bench_queries("bench_scale")

#: Big-project tiers: (objects per project at --largest 50000, share of the projects). The rest
#: of the projects share the rest of the objects evenly (about 35 each at the defaults).
TIERS = ((50_000, 0.0002), (10_000, 0.0015), (1_000, 0.025), (100, 0.25))
#: Every tier has at least this many projects, so the baseline has each size class too.
MIN_PER_TIER = 3
#: Starts of the private broker before the run gives up (see Private.kafka).
BROKER_STARTS = 3
#: Issue 18's goals.
LATENCY_RATIO_GOAL = 1.5
RECONCILE_GOAL_SECONDS = 60.0
#: The debounce of recalc_settings (spec 000): an isolated edit waits this long by design.
DEBOUNCE_SECONDS = 30.0
#: Soak minutes left out of the flatness verdicts: the first recomputes come after the debounce,
#: the first starvation-capped ones after 5 minutes.
SOAK_WARMUP_MINUTES = 5
#: Sizes are flat when the last window's mean is within this factor of the first window's, or
#: within SIZE_NOISE_KB of it.
SIZE_GROWTH_LIMIT = 1.25
SIZE_NOISE_KB = 256
#: Drain throughput is flat when every window of THROUGHPUT_WINDOW minutes is within this share
#: of their median.
THROUGHPUT_BAND = 0.20
THROUGHPUT_WINDOW = 5
#: Tables the soak watches: the debounce queue and the outbox (the issue's), and the per-session
#: counter rows every recompute and relay batch update.
CHURN_TABLES = (
    "chessboard.project_recalc_requests",
    "chessboard.outbox_events",
    "chessboard.metric_counters",
    "chessboard.recalc_worker_ticks",
    "chessboard.outbox_topic_stats",
)


def log(message: str, **fields: Any) -> None:
    print(
        json.dumps({"t": datetime.now().strftime("%H:%M:%S"), "msg": message, **fields}),
        file=sys.stderr,
        flush=True,
    )


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- catalogue shape --------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Projects per size: `counts[i]` projects of `sizes[i]` objects, then the filler projects
    sharing `filler_objects`."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    filler_projects: int
    filler_objects: int

    @property
    def projects(self) -> int:
        return sum(self.counts) + self.filler_projects

    @property
    def objects(self) -> int:
        return (
            sum(c * s for c, s in zip(self.counts, self.sizes, strict=True)) + self.filler_objects
        )

    @property
    def filler_size(self) -> int:
        return self.filler_objects // self.filler_projects

    def size_class(self, objects: int) -> int:
        """A project's class: its tier, or the filler size (filler projects differ by one)."""
        return objects if objects in self.sizes else self.filler_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "projects": self.projects,
            "property_objects": self.objects,
            "projects_by_size": {
                **{str(s): c for s, c in zip(self.sizes, self.counts, strict=True)},
                f"{self.filler_size}-{self.filler_size + 1}": self.filler_projects,
            },
        }


def _tier_counts(projects: int) -> tuple[int, ...]:
    return tuple(max(MIN_PER_TIER, round(share * projects)) for _, share in TIERS)


def catalogue_shape(projects: int, objects: int, largest: int) -> Shape:
    sizes = tuple(max(1, size * largest // 50_000) for size, _ in TIERS)
    counts = _tier_counts(projects)
    filler_projects = projects - sum(counts)
    filler_objects = objects - sum(c * s for c, s in zip(counts, sizes, strict=True))
    if filler_projects < 1 or filler_objects < filler_projects:
        raise SystemExit(
            f"{projects} projects / {objects} objects leave no room for the filler projects next"
            f" to the big tiers {dict(zip(sizes, counts, strict=True))}: raise --objects or lower"
            " --largest"
        )
    return Shape(sizes, counts, filler_projects, filler_objects)


def baseline_shape(large: Shape, projects: int) -> Shape:
    """The same size classes in a smaller catalogue: the same filler size, fewer projects."""
    counts = _tier_counts(projects)
    filler_projects = projects - sum(counts)
    if filler_projects < 1:
        raise SystemExit(f"--baseline-projects {projects} is too small for the tiers")
    return Shape(large.sizes, counts, filler_projects, filler_projects * large.filler_size)


# --- the bulk build ---------------------------------------------------------------------------


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
        # Raisers, foreign-key triggers and the tenant fill trigger stay quiet in this session.
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


def by_class(shape: Shape, sizes: dict[UUID, int]) -> dict[int, list[UUID]]:
    """Project ids per size class, in random order (the plan's order is random)."""
    classes: dict[int, list[UUID]] = {}
    for project_id, objects in sizes.items():
        classes.setdefault(shape.size_class(objects), []).append(project_id)
    return dict(sorted(classes.items(), reverse=True))


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


# --- recompute latency, drain throughput, CPU per project -------------------------------------


def one_object_per_project(dsn: str, project_ids: list[UUID]) -> dict[UUID, UUID]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (project_id) project_id, id FROM chessboard.property_objects"
            " WHERE project_id = ANY(%s) AND deleted_at IS NULL"
            " ORDER BY project_id, id",
            (project_ids,),
        ).fetchall()
    return {r[0]: r[1] for r in rows}


def recompute_once(conn: psycopg.Connection, dsn: str, project_id: UUID, object_id: UUID) -> float:
    """A real change (the object becomes Free, or Booked when it is Free: the free count moves),
    the project due now, one drain tick of one project: its recompute time as the drain
    measures it."""
    conn.execute(
        "UPDATE chessboard.property_objects SET status = CASE status WHEN 'Free' THEN 'Booked'"
        " ELSE 'Free' END WHERE id = %s",
        (object_id,),
    )
    Q.make_due(conn, project_ids=[project_id])
    (result,) = drain_tick(dsn, batch_size=1).results
    assert result.outcome == "recalculated" and result.project_id == project_id, result
    return result.duration_seconds


def latency_samples(
    dsns: dict[str, str], picks: dict[str, list[UUID]], samples: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Recompute times (seconds) per database of `picks`: each project's first touch, then
    `samples` round-robin over them, the databases taking turns sample by sample."""
    objects = {label: one_object_per_project(dsn, picks[label]) for label, dsn in dsns.items()}
    first: dict[str, list[float]] = {label: [] for label in dsns}
    warm: dict[str, list[float]] = {label: [] for label in dsns}
    with ExitStack() as stack:
        conns = {
            label: stack.enter_context(psycopg.connect(dsn, autocommit=True))
            for label, dsn in dsns.items()
        }
        turns = [(i, first) for i in range(max(map(len, picks.values())))]
        turns += [(i, warm) for i in range(samples)]
        for i, into in turns:
            for label, dsn in dsns.items():
                if into is first and i >= len(picks[label]):
                    continue
                project = picks[label][i % len(picks[label])]
                into[label].append(
                    recompute_once(conns[label], dsn, project, objects[label][project])
                )
    return first, warm


def recompute_latency(
    dsns: dict[str, str], classes: dict[str, dict[int, list[UUID]]], samples: int, distinct: int
) -> dict[str, Any]:
    """Per size class: up to `distinct` projects in each database, each recomputed once
    unmeasured (their first touch, reported apart), then round-robin until `samples`. The
    databases take turns sample by sample: on the shared machine the load swings within seconds,
    and two blocks measured one after the other compare two moments of other people's work, not
    two catalogues (the first full run, which measured them in blocks, had the 1,000-object class
    twice as slow in the large catalogue and the two biggest classes almost twice as slow in the
    small one)."""
    out: dict[str, Any] = {}
    for size in next(iter(classes.values())):
        picks = {label: classes[label][size][:distinct] for label in dsns}
        first, warm = latency_samples(dsns, picks, samples)
        row: dict[str, Any] = {
            label: {
                **quantiles(warm[label]),
                "projects": len(picks[label]),
                "first_touch_p50_ms": quantiles(first[label])["p50_ms"],
                "first_touch_max_ms": round(max(first[label]) * 1000, 3),
            }
            for label in dsns
        }
        large, base = row["large"], row["baseline"]
        row["ratio_p50"] = round(large["p50_ms"] / base["p50_ms"], 2)
        row["ratio_p99"] = round(large["p99_ms"] / base["p99_ms"], 2)
        row["ok"] = max(row["ratio_p50"], row["ratio_p99"]) <= LATENCY_RATIO_GOAL
        out[str(size)] = row
        log("latency", size=size, ratio_p50=row["ratio_p50"], ratio_p99=row["ratio_p99"])
    return out


def edit_and_make_due(dsn: str, project_ids: list[UUID]) -> None:
    """Every project gets a real change and is due now, as after the debounce."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        Q.edit_one_object_each(conn, project_ids=project_ids)
        Q.make_due(conn, project_ids=project_ids)


def throughput(dsns: dict[str, str], mixes: dict[str, list[UUID]], rounds: int) -> dict[str, Any]:
    """Drain throughput with 1 and 2 worker processes over the same mix of project sizes in each
    database, alternating between them; medians of `rounds`."""
    rates: dict[str, dict[int, list[float]]] = {label: {1: [], 2: []} for label in dsns}
    for _ in range(rounds):
        for workers in (1, 2):
            for label, dsn in dsns.items():
                edit_and_make_due(dsn, mixes[label])
                rates[label][workers].append(drain_throughput(dsn, workers))
    out: dict[str, Any] = {"projects": len(mixes["large"]), "rounds": rounds}
    for workers in (1, 2):
        medians = {label: statistics.median(r[workers]) for label, r in rates.items()}
        out[f"workers_{workers}"] = {
            **{f"{label}_projects_per_s": round(v, 1) for label, v in medians.items()},
            "ratio": round(medians["large"] / medians["baseline"], 2),
        }
    return out


def recompute_cpu(
    dsns: dict[str, str], classes: dict[str, dict[int, list[UUID]]], meter: Callable[[], CpuMeter]
) -> dict[str, Any]:
    """CPU-seconds per recalculated project by size, in each database: per class, a batch of
    changed projects (up to 2,000; the baseline has fewer of the big classes) drained by one
    worker process in ticks of the configured batch size, as a drain run does; the worker's CPU
    plus its backend's. (One tick of the whole batch would overcharge a long batch: each claim
    of a tick excludes the projects the tick already tried, a list as long as the tick.) Unlike
    wall time, CPU-seconds barely move with other people's load; a batch of a few big projects
    is near the meter's resolution (SAMPLE_SECONDS per process)."""
    out: dict[str, Any] = {}
    for size in classes["large"]:
        row: dict[str, Any] = {}
        for label, dsn in dsns.items():
            chosen = classes[label][size][: min(2000, max(10, 500_000 // size))]
            edit_and_make_due(dsn, chosen)
            with meter() as m:
                rate = drain_throughput(dsn, 1)
            cpu = m.totals()
            row[label] = {
                "projects": len(chosen),
                "cpu_ms_per_project": round(sum(cpu.values()) / len(chosen) * 1000, 2),
                "postgres_ms_per_project": round(cpu.get("postgres", 0.0) / len(chosen) * 1000, 2),
                "worker_ms_per_project": round(cpu.get("python", 0.0) / len(chosen) * 1000, 2),
                "projects_per_s": round(rate, 1),
            }
        large, base = row["large"]["cpu_ms_per_project"], row["baseline"]["cpu_ms_per_project"]
        # None: a batch too short for the meter's 50 ms samples (tiny CI sizes only).
        row["ratio"] = round(large / base, 2) if base else None
        out[str(size)] = row
    return out


# --- private services: Kafka broker, embedded ClickHouse, `pin` commands ----------------------


def _port_pair() -> int:
    """A free port whose successor is free too (the broker's controller listener)."""
    while True:
        port = free_port()
        if not port_open("127.0.0.1", port + 1, timeout=0.2) and port + 1 < 65536:
            return port


class Private:
    """A Kafka broker of this run (jars shared with `pin stack up`'s), embedded ClickHouse
    folders and Dagster homes, under one temporary folder removed at the end."""

    def __init__(self, stack: ExitStack) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pin-bench-scale-"))
        stack.callback(shutil.rmtree, self.root, ignore_errors=True)
        self._stack = stack
        self._kafka: LocalKafka | None = None

    def kafka(self) -> LocalKafka:
        """The broker, started on first use. A start that fails is logged with the broker's
        own output and tried again on new ports (up to BROKER_STARTS times): on the shared
        machine a start can fail (the first full-size soak's broker exited during start-up;
        another engineer's test may take the port pair between its choice and the bind), and one
        failed start must not cost a 36-minute soak."""
        for attempt in range(1, BROKER_STARTS + 1):
            if self._kafka is not None:
                break
            broker = LocalKafka(
                Settings.from_env(
                    {
                        "PIN_STATE_DIR": str(self.root / "state"),
                        "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{_port_pair()}",
                    }
                )
            )
            shared_jars = LocalKafka(Settings.from_env()).libs
            broker.root.mkdir(parents=True)
            if shared_jars.exists():
                broker.libs.symlink_to(shared_jars)
            self._stack.callback(self._stop_broker, broker)
            try:
                broker.up()
            except PinError as error:
                stdout = broker.root / "stdout.log"
                log(
                    "broker start failed",
                    attempt=attempt,
                    error=str(error)[-300:],
                    stdout=stdout.read_text(errors="replace")[-1500:] if stdout.exists() else "",
                )
                if attempt == BROKER_STARTS:
                    raise
                self._stop_broker(broker)
                shutil.rmtree(broker.root)
                continue
            ensure_topics(broker.settings.kafka_bootstrap)
            self._kafka = broker
        assert self._kafka is not None
        return self._kafka

    @staticmethod
    def _stop_broker(broker: LocalKafka) -> None:
        """Stops the broker if it runs, then collects it (this process started it: no zombie,
        whether it was stopped here or died on its own)."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(broker.pidfile.read_text())
            broker.down()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def env(self, dsn: str, label: str) -> dict[str, str]:
        """The environment of a `pin` command or `pin serve` on `dsn`: this run's broker, a
        ClickHouse folder per database, a relay transactional.id per database."""
        return {
            **os.environ,
            "PIN_PG_DSN": dsn,
            "PIN_KAFKA_BOOTSTRAP": self.kafka().settings.kafka_bootstrap,
            "PIN_CLICKHOUSE_URL": f"chdb://{self.root / f'chdb_{label}'}",
            "PIN_STATE_DIR": str(self.root / "state"),
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-bench-scale-{label}",
        }


def run_pin(args: list[str], env: dict[str, str], meter: Callable[[], CpuMeter]) -> dict[str, Any]:
    """A `pin` command: its JSON summary, wall seconds and the CPU of everything it used."""
    started = time.perf_counter()
    with meter() as m:
        done = subprocess.run(
            [sys.executable, "-m", "pin_pipelines.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"pin {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
    return {
        "summary": json.loads(done.stdout.strip().splitlines()[-1]),
        "seconds": round(time.perf_counter() - started, 2),
        "cpu": m.totals(),
    }


def events_and_reconcile(
    dsn: str, label: str, private: Private, meter: Callable[[], CpuMeter], objects: int
) -> dict[str, Any]:
    """Every layout group published into the outbox (with the events the measures before left
    there), relayed, loaded into the dimension, then `pin reconcile` over the whole catalogue.
    Each `pin` command runs twice, the second time with nothing to do: the difference is the
    marginal CPU per event."""
    env = private.env(dsn, label)
    run_pin(["db", "migrate"], env, meter)  # the ClickHouse database; PostgreSQL is current
    with psycopg.connect(dsn, autocommit=True) as conn:
        groups = Q.publish_all_layout_groups(conn)
        (outbox,) = conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone() or (0,)

    def per_event(args: list[str], count: int) -> dict[str, Any]:
        busy, idle = run_pin(args, env, meter), run_pin(args, env, meter)
        marginal = sum(busy["cpu"].values()) - sum(idle["cpu"].values())
        return {
            "events": count,
            "seconds": busy["seconds"],
            "events_per_s": round(count / busy["seconds"], 1),
            "cpu": busy["cpu"],
            "fixed_cpu": idle["cpu"],
            "cpu_us_per_event": round(marginal / count * 1e6, 1),
            "summary": busy["summary"],
        }

    relay = per_event(["outbox", "relay", "--once"], int(outbox))
    load = per_event(["devstats", "load", "--once"], int(groups))
    reconcile = run_pin(["reconcile"], env, meter)
    summary = reconcile["summary"]
    drifted = summary["projects_drifted"] + summary["dim_rows_drifted"]
    return {
        "relay": relay,
        "load": load,
        "reconcile": {
            "seconds": reconcile["seconds"],
            "cpu": reconcile["cpu"],
            "cpu_s_per_million_objects": round(sum(reconcile["cpu"].values()) / objects * 1e6, 2),
            "projects_checked": summary["projects_checked"],
            "dim_rows_checked": summary["dim_rows_checked"],
            "drifted": drifted,
            "ok": reconcile["seconds"] < RECONCILE_GOAL_SECONDS and drifted == 0,
        },
    }


# --- `pin serve` under an edit load -----------------------------------------------------------


@dataclass
class _Edit:
    committed: float
    due_at: float
    fresh: bool  # this edit opened its project's debounce window


@dataclass
class EditResults:
    """What the edit load saw. Lags (seconds) only of edits committed after the warm-up."""

    committed: list[float] = field(default_factory=list)
    #: commit → aggregates updated, for an edit that opened its project's debounce window and
    #: was the only edit of its recompute: the debounce plus the pipeline's delay.
    lag_isolated: list[float] = field(default_factory=list)
    #: commit → aggregates updated for every edit: with edits every few seconds on the big
    #: projects, the trailing debounce and the 5-minute starvation cap are in here by design.
    lag_any: list[float] = field(default_factory=list)
    #: recompute start − the due_at the project's last included edit left: the pipeline's own
    #: delay (sensor tick, run launch, queue), whatever the debounce did.
    delay_after_due: list[float] = field(default_factory=list)
    #: (commit time, lag) of every resolved edit, for per-minute lags.
    resolved: list[tuple[float, float]] = field(default_factory=list)
    unresolved: int = 0


@dataclass
class _EditLoad:
    """The parameters of one edit load (a worker process)."""

    dsn: str
    pool: list[tuple[UUID, UUID]]
    rate: float
    seconds: float
    warmup_seconds: float
    settle_seconds: float


def edit_pool(dsn: str, edits: int) -> list[tuple[UUID, UUID]]:
    """(object, project) pairs of random Free objects, in random order: projects are edited in
    proportion to their size, as sales are. (The sample comes in table order, where a project's
    objects are neighbours: unshuffled, the edits would sweep through one project after another
    and coalesce far more than real ones.)"""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM chessboard.property_objects"
            " WHERE status = 'Free' AND deleted_at IS NULL"
        ).fetchone()
        percent = min(100.0, 130.0 * edits / max(1, int(row[0]) if row else 1))
        pool = [(r[0], r[1]) for r in Q.edit_pool(conn, percent=percent)]
    if len(pool) < edits:
        raise SystemExit(f"only {len(pool)} free objects for {edits} edits")
    random.shuffle(pool)
    return pool


def edit_load(
    load: _EditLoad,
    ready: multiprocessing.Queue[list[int]],
    go: Any,
    progress: Any,
    out: multiprocessing.Queue[EditResults],
) -> None:
    """A worker process: `rate` edits/s for `seconds`, each a sale (status Sold) or, every
    fourth, a withdrawal (Hidden) of one Free object, so the recompute after an edit always moves
    its project's free count and updated_at. Each edit reads its queue row back in its own
    transaction (due_at, and whether it opened the debounce window). A second connection polls
    the edited projects' updated_at twice a second; after the load, until every edit is seen or
    `settle_seconds` pass."""
    results = EditResults()
    edit_conn = psycopg.connect(load.dsn)
    poll_conn = psycopg.connect(load.dsn, autocommit=True)
    ready.put([edit_conn.info.backend_pid, poll_conn.info.backend_pid])
    go.wait()
    pending: dict[UUID, list[_Edit]] = {}
    start = time.time()
    measure_from = start + load.warmup_seconds
    stop_loading = start + load.seconds
    next_poll = start
    i = 0

    def poll() -> None:
        rows = poll_conn.execute(
            "SELECT id, extract(epoch FROM updated_at)::float8 FROM chessboard.projects"
            " WHERE id = ANY(%s)",
            (list(pending),),
        ).fetchall()
        for project_id, updated in rows:
            done = [e for e in pending[project_id] if e.committed < updated]
            if not done:
                continue
            pending[project_id] = [e for e in pending[project_id] if e.committed >= updated]
            if not pending[project_id]:
                del pending[project_id]
            last = max(done, key=lambda e: e.committed)
            if last.committed >= measure_from:
                results.delay_after_due.append(updated - last.due_at)
            for e in done:
                if e.committed >= measure_from:
                    results.lag_any.append(updated - e.committed)
                    results.resolved.append((e.committed, updated - e.committed))
                    if len(done) == 1 and e.fresh:
                        results.lag_isolated.append(updated - e.committed)

    while True:
        now = time.time()
        if now < stop_loading and now >= start + i / load.rate:
            object_id, project_id = load.pool[i % len(load.pool)]
            i += 1
            changed = edit_conn.execute(
                "UPDATE chessboard.property_objects SET status = %s, version = version + 1,"
                " updated_at = now() WHERE id = %s AND status = 'Free'",
                ("Hidden" if i % 4 == 0 else "Sold", object_id),
            ).rowcount
            queued = edit_conn.execute(
                "SELECT extract(epoch FROM due_at)::float8, requested_count"
                " FROM chessboard.project_recalc_requests WHERE project_id = %s",
                (project_id,),
            ).fetchone()
            edit_conn.commit()
            if changed and queued is not None:
                committed = time.time()
                results.committed.append(committed)
                progress.value += 1
                pending.setdefault(project_id, []).append(
                    _Edit(committed, float(queued[0]), queued[1] == 1)
                )
            continue
        if now >= next_poll:
            if pending:
                poll()
            if now >= stop_loading and (not pending or now >= stop_loading + load.settle_seconds):
                break
            next_poll = now + 0.5
        wake = min(next_poll, start + i / load.rate) if now < stop_loading else next_poll
        time.sleep(max(0.0, min(0.05, wake - time.time())))
    results.unresolved = sum(
        1 for edits in pending.values() for e in edits if e.committed >= measure_from
    )
    edit_conn.close()
    poll_conn.close()
    out.put(results)


@contextmanager
def serving(dsn: str, label: str, private: Private) -> Iterator[None]:
    """`pin serve` on `dsn` with a private DAGSTER_HOME, storage database (`<database>_dagster`)
    and port; stopped with SIGTERM and waited for."""
    storage = storage_database(dsn)
    admin = dsn_with_dbname(dsn, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{storage}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{storage}"')
    port = free_port()
    env = {
        **private.env(dsn, label),
        "DAGSTER_HOME": str(private.root / f"dagster_home_{label}"),
        "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn, storage),
        "PIN_DAGSTER_PORT": str(port),
    }
    with open(private.root / f"serve_{label}.log", "ab") as logfile:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pin_pipelines.cli", "serve"],
            env=env,
            stdout=logfile,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            while not port_open("127.0.0.1", port):
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"pin serve did not come up; see {logfile.name}")
                time.sleep(1)
            yield
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(90)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{storage}" WITH (FORCE)')


def wait_for_exit(pids: list[int], timeout: float) -> None:
    """Dagster run workers outlive the daemon that launched them (a drain run spends its
    budget): waited for, killed after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive:
        alive = [p for p in alive if _running(p)]
        if alive and time.monotonic() > deadline:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = math.inf
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sample_pipeline(conn: psycopg.Connection, databases: list[str]) -> dict[str, Any]:
    """Sizes (bytes) and churn of the watched tables, queue and outbox rows, drain counters,
    and the sessions and statement time of `databases`."""
    counts = Q.pipeline_counts(conn)
    return {
        "at": time.time(),
        "databases": {
            r[0]: (int(r[1]), float(r[2])) for r in Q.database_activity(conn, names=databases)
        },
        "tables": {
            r[0]: dict(
                zip(
                    ("heap", "indexes", "total", "live", "dead", "autovacuums"), r[1:7], strict=True
                )
            )
            for r in Q.relation_sizes(conn, tables=list(CHURN_TABLES))
        },
        "indexes": dict(Q.index_sizes(conn, tables=list(CHURN_TABLES))),
        "queued": counts[0],
        "due": counts[1],
        "outbox": counts[2],
        "recalculated": float(counts[3]),
        "recalc_seconds": float(counts[4]),
        "relayed": int(counts[5]),
    }


def minute_row(
    minute: int, before: dict[str, Any], after: dict[str, Any], edits: int, cpu: dict[str, float]
) -> dict[str, Any]:
    drained = after["recalculated"] - before["recalculated"]
    seconds = after["at"] - before["at"]
    spent = after["recalc_seconds"] - before["recalc_seconds"]
    return {
        "minute": minute,
        "edits": edits,
        "drained": int(drained),
        "mean_recompute_ms": round(spent / drained * 1000, 2) if drained else None,
        "relayed": after["relayed"] - before["relayed"],
        "queued": after["queued"],
        "due": after["due"],
        "outbox_rows": after["outbox"],
        "total_kb": {name: t["total"] // 1024 for name, t in after["tables"].items()},
        "index_kb": {name: size // 1024 for name, size in after["indexes"].items()},
        "live": {name: t["live"] for name, t in after["tables"].items()},
        "dead": {name: t["dead"] for name, t in after["tables"].items()},
        "autovacuums": {name: t["autovacuums"] for name, t in after["tables"].items()},
        "cpu_cores": {kind: round(s / seconds, 3) for kind, s in cpu.items()},
        **database_load(before, after),
    }


def database_load(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per database between two samples: sessions opened per second and the cores its
    statements kept busy (executing time, lock and commit-flush waits included)."""
    seconds = after["at"] - before["at"]
    return {
        "sessions_per_s": {
            name: round((sessions - before["databases"][name][0]) / seconds, 2)
            for name, (sessions, _) in after["databases"].items()
        },
        "statement_cores": {
            name: round((active - before["databases"][name][1]) / 1000 / seconds, 3)
            for name, (_, active) in after["databases"].items()
        },
    }


def under_load(
    dsn: str,
    label: str,
    private: Private,
    meter: Callable[[], CpuMeter],
    rate: float,
    minutes: float,
    warmup_seconds: float,
    per_minute: bool,
) -> dict[str, Any]:
    """`pin serve` on `dsn` while an edit load runs `warmup_seconds` + `minutes`; lags are of
    the edits after the warm-up. With `per_minute` (the soak), the watched tables, the drain and
    the CPU are sampled every minute."""
    seconds = warmup_seconds + minutes * 60
    load = _EditLoad(
        dsn=dsn,
        pool=edit_pool(dsn, math.ceil(rate * seconds) + 100),
        rate=rate,
        seconds=seconds,
        warmup_seconds=warmup_seconds,
        # After the load the last edits wait out their debounce (the starvation cap at worst).
        settle_seconds=DEBOUNCE_SECONDS + 300,
    )
    ready: multiprocessing.Queue[list[int]] = multiprocessing.Queue()
    results: multiprocessing.Queue[EditResults] = multiprocessing.Queue()
    go = multiprocessing.Event()
    progress = multiprocessing.Value("i", 0)
    rows: list[dict[str, Any]] = []
    databases = [database_name(dsn), storage_database(dsn)]
    log("serve", database=label, edit_rate=rate, minutes=minutes)
    with serving(dsn, label, private), meter() as m, psycopg.connect(dsn, autocommit=True) as conn:
        m.relabel(conn.info.backend_pid, "sampler")
        time.sleep(20)  # daemon, code server and sensors up before the load starts
        worker = multiprocessing.Process(
            target=edit_load, args=(load, ready, go, progress, results)
        )
        worker.start()
        edit_backend, poll_backend = ready.get(timeout=60)
        m.relabel(edit_backend, "edits")
        m.relabel(poll_backend, "sampler")
        go.set()
        started = time.time()
        before, cpu_before, edits_before = sample_pipeline(conn, databases), m.totals(), 0
        first = before
        minute = 0
        while per_minute and time.time() < started + seconds:
            minute += 1
            time.sleep(max(0.0, started + 60 * minute - time.time()))
            after, cpu_after, edits = sample_pipeline(conn, databases), m.totals(), progress.value
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
            rows.append(minute_row(minute, before, after, edits - edits_before, cpu))
            log("soak", **{k: v for k, v in rows[-1].items() if k not in ("index_kb", "live")})
            before, cpu_before, edits_before = after, cpu_after, edits
        found = results.get()  # the load, then the settling of its last edits
        worker.join()
        cpu_total = m.totals()
        end = sample_pipeline(conn, databases)
        elapsed = time.time() - started
        dagster_pids = m.pids("dagster")
    wait_for_exit(dagster_pids, 60)
    out: dict[str, Any] = {
        "edit_rate_target": rate,
        "edits": len(found.committed),
        "edit_rate": round(len(found.committed) / seconds, 2),
        "warmup_seconds": warmup_seconds,
        "minutes_measured": minutes,
        "lag_isolated_edit": seconds_quantiles(found.lag_isolated, with_max=True),
        "lag_any_edit": seconds_quantiles(found.lag_any, with_max=True),
        "delay_after_due": seconds_quantiles(found.delay_after_due, with_max=True),
        "unresolved_edits": found.unresolved,
        "recalculated_per_s": round((end["recalculated"] - first["recalculated"]) / elapsed, 2),
        "relayed_per_s": round((end["relayed"] - first["relayed"]) / elapsed, 2),
        "cpu_cores_mean": {k: round(v / elapsed, 3) for k, v in cpu_total.items()},
        **database_load(first, end),
        "cpu_ms_per_edit": round(
            cpu_total.get("edits", 0.0) / max(1, len(found.committed)) * 1e3, 3
        ),
    }
    if per_minute:
        out["minutes"] = rows
        out["lag_by_minute"] = [
            {"minute": m_, **(seconds_quantiles(v, with_max=True) or {})}
            for m_, v in sorted(_by_minute(found.resolved, started).items())
        ]
        out["verdict"] = soak_verdict(rows)
    return out


def _by_minute(resolved: list[tuple[float, float]], started: float) -> dict[int, list[float]]:
    buckets: dict[int, list[float]] = {}
    for committed, lag in resolved:
        buckets.setdefault(int((committed - started) // 60) + 1, []).append(lag)
    return buckets


def soak_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Flat or not, after the warm-up minutes. Sizes: each table's and index's mean over the last
    window (up to 10 minutes) against the first, and the least-squares slope over all steady
    minutes; a relation is flat when the last window is within SIZE_GROWTH_LIMIT of the first or
    within SIZE_NOISE_KB (a few pages: autovacuum's minute decides where a small table stands).
    Throughput: projects drained per minute in windows of THROUGHPUT_WINDOW minutes (a single
    minute swings with where drain runs start and end) against their median."""
    steady = [r for r in rows if r["minute"] > SOAK_WARMUP_MINUTES]
    if len(steady) < 2:
        return {"steady_minutes": len(steady)}
    width = min(10, len(steady) // 2)
    first, last = steady[:width], steady[-width:]
    sizes: dict[str, Any] = {}
    for key in ("total_kb", "index_kb"):
        for name in steady[0][key]:
            series = [r[key][name] for r in steady]
            before = statistics.fmean(r[key][name] for r in first)
            after = statistics.fmean(r[key][name] for r in last)
            slope = statistics.linear_regression([r["minute"] for r in steady], series).slope
            sizes[name] = {
                "first_kb": round(before),
                "last_kb": round(after),
                "max_kb": max(series),
                "kb_per_hour": round(slope * 60),
                "flat": after <= before * SIZE_GROWTH_LIMIT or after - before <= SIZE_NOISE_KB,
            }
    windows = [
        statistics.fmean(r["drained"] for r in steady[i : i + THROUGHPUT_WINDOW])
        for i in range(0, len(steady) - THROUGHPUT_WINDOW + 1, THROUGHPUT_WINDOW)
    ]
    median = statistics.median(windows) if windows else 0.0
    band = max(abs(w - median) for w in windows) / median if median else math.inf
    recompute = [r["mean_recompute_ms"] for r in steady if r["mean_recompute_ms"] is not None]
    return {
        "steady_minutes": len(steady),
        "window_minutes": width,
        "sizes": sizes,
        "sizes_flat": all(v["flat"] for v in sizes.values()),
        "drained_per_minute_by_window": [round(w, 1) for w in windows],
        "drained_per_minute_single": {
            "min": min(r["drained"] for r in steady),
            "max": max(r["drained"] for r in steady),
        },
        "throughput_band": round(band, 3),
        "throughput_flat": band <= THROUGHPUT_BAND,
        "mean_recompute_ms_first_last": [
            round(statistics.fmean(recompute[:width]), 2),
            round(statistics.fmean(recompute[-width:]), 2),
        ]
        if recompute
        else None,
    }


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--projects", type=int, default=100_000)
    parser.add_argument("--objects", type=int, default=10_000_000)
    parser.add_argument(
        "--largest", type=int, default=50_000, help="objects of the biggest projects"
    )
    parser.add_argument("--baseline-projects", type=int, default=1_000)
    parser.add_argument(
        "--samples", type=int, default=200, help="recomputes per size class and database"
    )
    parser.add_argument("--distinct", type=int, default=20, help="projects per size class")
    parser.add_argument("--rounds", type=int, default=3, help="drain throughput rounds")
    parser.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="relay, load and reconcile on a private broker",
    )
    parser.add_argument("--edit-rate", type=float, default=20.0, help="edits/s under pin serve")
    parser.add_argument("--e2e-minutes", type=float, default=5.0, help="0: no pin serve phase")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load not measured")
    parser.add_argument("--soak", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument(
        "--database",
        default="pin_bench_scale",
        help="name of the large catalogue's database; the others get suffixes",
    )
    parser.add_argument(
        "--only-soak",
        action="store_true",
        help="build the large catalogue and soak it; no other measure",
    )
    args = parser.parse_args()
    # A SIGTERM (a stopped nohup run) unwinds like an error: databases dropped, broker and
    # `pin serve` stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    large_shape = catalogue_shape(args.projects, args.objects, args.largest)
    shapes = {"large": large_shape}
    if not args.only_soak:
        shapes["baseline"] = baseline_shape(large_shape, args.baseline_projects)
    names = {"large": args.database, "baseline": f"{args.database}_baseline"}
    result: dict[str, Any] = {
        "bench": "scale",
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_average()},
        "catalogues": {label: shape.as_dict() for label, shape in shapes.items()},
    }
    with ExitStack() as stack:
        dsns: dict[str, str] = {}
        for label in ("baseline", "large"):
            if label in shapes:
                stack.callback(drop_database, names[label])
                dsns[label] = fresh_database(names[label])
        classes: dict[str, dict[int, list[UUID]]] = {}
        for label, dsn in dsns.items():
            log("build", database=label, **shapes[label].as_dict())
            built, sizes = build_catalogue(dsn, shapes[label])
            classes[label] = by_class(shapes[label], sizes)
            result["catalogues"][label]["build"] = built
            result["catalogues"][label]["consistency"] = consistency(dsn, classes[label])
            log("built", database=label, **built)
        with psycopg.connect(dsns["large"]) as conn:
            server = postmaster_pid(conn.info.backend_pid)
        kinds = {names[label]: "postgres" for label in dsns}
        kinds.update({storage_database(dsn): "dagster_postgres" for dsn in dsns.values()})
        meter = lambda: CpuMeter(kinds, server)  # noqa: E731
        private = Private(stack)
        if not args.only_soak:
            result["recompute_latency_by_size"] = recompute_latency(
                dsns, classes, args.samples, args.distinct
            )
            mixes = {
                label: [
                    p
                    for size, members in classes[label].items()
                    for p in members[: len(classes["baseline"][size])]
                ]
                for label in dsns
            }
            log("throughput", projects=len(mixes["large"]))
            result["drain_throughput"] = throughput(dsns, mixes, args.rounds)
            log("cpu per project")
            result["recompute_cpu_by_size"] = recompute_cpu(dsns, classes, meter)
            if args.events:
                result["events_and_reconcile"] = {
                    label: events_and_reconcile(dsn, label, private, meter, shapes[label].objects)
                    for label, dsn in dsns.items()
                }
                log(
                    "reconcile",
                    **{
                        label: r["reconcile"]["seconds"]
                        for label, r in result["events_and_reconcile"].items()
                    },
                )
            if args.e2e_minutes > 0:
                result["e2e_under_pin_serve"] = {
                    label: under_load(
                        dsn,
                        label,
                        private,
                        meter,
                        args.edit_rate,
                        args.e2e_minutes,
                        args.warmup,
                        per_minute=False,
                    )
                    for label, dsn in dsns.items()
                }
        if args.soak > 0:
            result["soak"] = under_load(
                dsns["large"],
                "large",
                private,
                meter,
                args.edit_rate,
                args.soak,
                0.0,
                per_minute=True,
            )
        result["machine"]["load_average_end"] = load_average()
    print(json.dumps(result), flush=True)


def database_name(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


def storage_database(dsn: str) -> str:
    """The Dagster storage database of `pin serve` on `dsn`."""
    return f"{database_name(dsn)}_dagster"


def drop_database(name: str) -> None:
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
