"""Recalc benchmark. Prints ONE JSON line (the last line), progress on stderr.

1. Recompute latency of one project by size (a drain tick of batch 1 after a real change).
2. The drain against an independent baseline, the headline: the plain per-project
   implementation a team would write first (bench/sql/baseline_recalc.sql and `baseline_drain`
   below: per project ONE transaction that claims the queue row with SELECT ... FOR UPDATE SKIP
   LOCKED, calls ONE plpgsql function that recomputes and updates the four aggregate tables with
   IS DISTINCT FROM guards and writes the outbox events, deletes the row and commits). The same
   --projects x --objects data in two databases of the same server: `pin_bench_product`
   (migrated, filled) and `pin_bench_baseline`, a copy made from it with CREATE DATABASE ...
   TEMPLATE (same rows, same ids, same statistics), in which the function is created. After a
   first drain of both (unmeasured), --rounds rounds; each round measures, per workload and per
   worker count (1 and 2: processes with their own connections, sharing the queue through SKIP
   LOCKED), one pass of each side, the side going first alternating, and the worker counts in
   the order 1-2 in odd rounds, 2-1 in even ones; the figures are the medians of the rounds. A
   pass makes every project
   due and drains the whole queue in ticks of --batch projects on one connection per worker
   (the product: one drain run, `drain_until_idle` as the Dagster op calls it; the baseline:
   the same shape). Workloads
   (the same statements on both sides before the pass):
     steady   nothing changed since the last drain: nothing is written but the queue;
     edited   one object per project moved between Free and Hidden: a building, a layout and
              the project rewritten, 2 events per project;
     rewrite  every aggregate reset (and the published snapshots forgotten): every row
              rewritten and published, like the first drain of new data (7 events per project
              with the default size).
   Reported per side: projects/s (wall time of the pass), PostgreSQL backend CPU-seconds per
   project (the CPU clock of each backend serving the pass, found by its connection's backend
   pid and read just before that connection closes: exact, whatever else runs on the machine;
   needs the server on this machine) and the drain processes' own CPU (their CPU clocks); and
   the ratios product / baseline of throughput (goal >= 1.0) and of backend CPU (goal <= 1.0).
   Scale-out by cost (`scale_out_cpu_ratio`): the product's CPU per project (its drains' and
   their backends') with 2 workers / with 1, goal <= 1.15; unlike projects/s it does not need
   spare cores to show. The medians' ratio, and each round's (`scale_out_cpu_ratio_by_round`).
   After every pass pair the two databases must agree: the same aggregates and versions in the
   four tables, an empty queue, and the same events (topic, key, payload but its EventId and
   CreatedAt, traceparent, defect); at the end both are checked against the truth
   (tests/support/truth.py) when --truth says so.
3. The drain against pgbench running the drain's own statements (the product database, steady
   state).

    .venv/bin/python bench/bench_recalc.py [--quick] [--projects 1000] [--objects 50]
        [--batch 50] [--rounds 4] [--workloads steady,edited,rewrite] [--no-latency]
        [--no-pgbench] [--truth auto|yes|no]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
# tests.support.truth: the aggregates recomputed in Python, shared with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import BASE_DSN, BENCH_SQL, bench_queries, drain_all, fresh_database, quantiles
from _cpu import process_cpu_seconds

from pin_pipelines.config import SQL_DIR, dsn_with_dbname
from pin_pipelines.recalc import drain
from pin_pipelines.recalc.drain import drain_tick, drain_until_idle
from pin_pipelines.stack.postgres import bindir
from tests.support.truth import actual_aggregates, drift, versions

BASELINE_SQL = BENCH_SQL / "baseline_recalc.sql"
SIDES = ("product", "baseline")
WORKLOADS = ("steady", "edited", "rewrite")


def insert_projects(dsn: str, projects: int, objects: int) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = bench_queries("bench").insert_bench_projects(
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


def pgbench_script(batch: int) -> str:
    """The drain's statement for one tick, from the named-query file, as a pgbench script."""
    text = (SQL_DIR / "postgres" / "queries" / "recalc.sql").read_text()
    blocks = dict(re.findall(r"-- name: (\w+)\([^)]*\)[$^!]?\n(.*?)(?=\n-- name:|\Z)", text, re.S))
    lines = [ln for ln in blocks["recalc_tick"].splitlines() if not ln.lstrip().startswith("--")]
    values = {
        ":batch": str(batch),
        ":claim_for": f"interval '{drain.CLAIM_WINDOW_SECONDS} seconds'",
        ":attempted": "NULL",
        ":traceparents": "NULL",
        ":lock_share": str(drain.LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT),
    }
    call = "\n".join(lines).strip()
    for name, value in values.items():
        call = call.replace(name, value)
    return call + "\n"


def pgbench_throughput(dsn: str, clients: int, projects: int, batch: int) -> float:
    """Projects/s of pgbench's clients running the drain's statement until the queue is
    drained (a tick of `batch` per call: projects / batch / clients calls each)."""
    make_due(dsn)
    parts = urlsplit(dsn)
    calls = max(1, projects // batch // clients)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(pgbench_script(batch))
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
        str(calls),
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
    with psycopg.connect(dsn) as conn:
        left = conn.execute("SELECT count(*) FROM chessboard.project_recalc_requests").fetchone()
    assert left is not None
    # Every call's own count is not returned to pgbench: the projects done over the calls' time.
    return (projects - int(left[0])) * float(match.group(1)) / (calls * clients)


# --- the drain against the independent baseline -----------------------------------

#: The baseline's statements (bench/sql/baseline_recalc.sql has the function). Oldest due first, as
#: the product; no attempt counted, no poison threshold, no retry interval: the plain version.
BASELINE_CLAIM = (
    "SELECT project_id FROM chessboard.project_recalc_requests"
    " WHERE due_at <= now() ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED"
)
BASELINE_RECALC = "SELECT bench_baseline.recalc_project(%s)"
BASELINE_DELETE = "DELETE FROM chessboard.project_recalc_requests WHERE project_id = %s"
#: A pass is one drain run per worker: its budget only bounds a pass that went wrong.
PASS_BUDGET_SECONDS = 600.0

#: What each workload changes before its pass, the same statements in both databases. The data
#: modifications fire the raisers (the rewrite's touch only derived columns, which never
#: enqueue); make_due then makes every project due now.
PREPARE: dict[str, list[str]] = {
    "steady": [],
    "edited": [
        "UPDATE chessboard.property_objects po"
        " SET status = CASE WHEN po.status = 'Hidden' THEN 'Free' ELSE 'Hidden' END"
        " WHERE po.id IN (SELECT DISTINCT ON (project_id) id FROM chessboard.property_objects"
        " ORDER BY project_id, id)"
    ],
    "rewrite": [
        "UPDATE chessboard.buildings"
        " SET property_objects_total_count = 0, property_objects_free_count = 0",
        "UPDATE chessboard.layouts SET property_objects_count = 0, published_snapshot = NULL",
        "UPDATE chessboard.layout_groups"
        " SET layouts_count = 0, area_min = NULL, area_max = NULL, published_snapshot = NULL",
        "UPDATE chessboard.projects SET property_objects_total_count = 0,"
        " property_objects_free_count = 0, price_min = NULL, price_max = NULL,"
        " published_snapshot = NULL",
    ],
}
#: Before every pass, in both databases: the dead rows of the previous pass gone and the
#: statistics of the small tables re-read whole (deterministic: fewer rows than ANALYZE's
#: sample), so autovacuum's timing does not make one side's plans or scans differ. The objects'
#: statistics stay those the copy took from the first database.
VACUUM = (
    "VACUUM (ANALYZE) chessboard.project_recalc_requests, chessboard.projects,"
    " chessboard.buildings, chessboard.layouts, chessboard.layout_groups",
    "VACUUM chessboard.property_objects, chessboard.outbox_events",
)


def clone_database(source_dsn: str, name: str) -> str:
    """`name` dropped and created again as a copy of the source database (its rows, ids and
    statistics), with the source's per-database settings (migration 0010's jit = off is one);
    returns its DSN."""
    source = urlsplit(source_dsn).path.lstrip("/")
    gc.collect()  # migrate_postgres's yoyo backend keeps its connection until collected
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(source)
            )
        )
        settings = conn.execute(
            "SELECT unnest(s.setconfig) FROM pg_db_role_setting s"
            " JOIN pg_database d ON d.oid = s.setdatabase"
            " WHERE d.datname = %s AND s.setrole = 0",
            (source,),
        ).fetchall()
        for (setting,) in settings:
            key, value = setting.split("=", 1)
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name), sql.Identifier(key), sql.Literal(value)
                )
            )
    return dsn_with_dbname(BASE_DSN, name)


def setup_pair(projects: int, objects: int, batch: int) -> dict[str, str]:
    """The product's database, migrated and filled, and the baseline's copy of it with the
    baseline's function."""
    product = fresh_database("pin_bench_product")
    insert_projects(product, projects, objects)
    with psycopg.connect(product, autocommit=True) as conn:
        conn.execute("UPDATE chessboard.recalc_settings SET batch_size = %s", (batch,))
    baseline = clone_database(product, "pin_bench_baseline")
    with psycopg.connect(baseline, autocommit=True) as conn:
        conn.execute(BASELINE_SQL.read_text())
    dsns = {"product": product, "baseline": baseline}
    jit = {}
    for side, dsn in dsns.items():
        with psycopg.connect(dsn) as conn:
            jit[side] = conn.execute("SHOW jit").fetchone()[0]  # type: ignore[index]
    assert jit["product"] == jit["baseline"], jit
    return dsns


class BackendCpu:
    """CPU-seconds of the PostgreSQL backends of one process's connections: each backend's
    CPU clock over its whole life (fork and start-up included), read just before its
    connection closes."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.backends = 0

    def add(self, conn: psycopg.Connection) -> None:
        pid = conn.info.backend_pid
        cpu = process_cpu_seconds(pid)
        if cpu is None:
            raise RuntimeError(
                f"backend {pid} is not in /proc: the PostgreSQL server must run on this machine"
            )
        self.seconds += cpu
        self.backends += 1


@contextmanager
def product_connections(
    around: Callable[[psycopg.Connection], AbstractContextManager[object]],
) -> Iterator[None]:
    """Each of the drain's connections (one per drain run) inside `around(conn)` until it closes;
    the drain itself is not touched."""
    opened = drain.connection

    @contextmanager
    def hooked(dsn: str, **kwargs: Any) -> Iterator[psycopg.Connection]:
        with opened(dsn, **kwargs) as conn, around(conn):
            yield conn

    drain.connection = hooked
    try:
        yield
    finally:
        drain.connection = opened


@contextmanager
def _metered(meter: BackendCpu, conn: psycopg.Connection) -> Iterator[None]:
    try:
        yield
    finally:
        if not conn.closed:
            meter.add(conn)


def product_drain(dsn: str, meter: BackendCpu) -> int:
    """One drain run (`drain_until_idle`, as the Dagster op runs it): ticks of the configured
    batch size on one connection until one finds nothing due; every project must be
    recalculated."""
    with product_connections(lambda conn: _metered(meter, conn)):
        run = drain_until_idle(dsn, budget_seconds=PASS_BUDGET_SECONDS, wait_for_due_within=0)
    outcomes = Counter(r.outcome for tick in run.ticks for r in tick.results)
    assert set(outcomes) == {"recalculated"}, outcomes
    return outcomes["recalculated"]


def baseline_tick(conn: psycopg.Connection, batch: int) -> int:
    """Up to `batch` projects, per project one transaction, committed once; returns the
    projects done."""
    claimed = 0
    for _ in range(batch):
        with conn.transaction():
            row = conn.execute(BASELINE_CLAIM).fetchone()
            if row is None:
                break
            conn.execute(BASELINE_RECALC, row)
            conn.execute(BASELINE_DELETE, row)
        claimed += 1
    return claimed


def baseline_drain(dsn: str, batch: int, meter: BackendCpu) -> int:
    """The baseline's drain in the product's shape: one connection, ticks until one finds
    nothing due."""
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn, _metered(meter, conn):
        while claimed := baseline_tick(conn, batch):
            done += claimed
    return done


@dataclass
class WorkerResult:
    projects: int = 0
    finished: float = 0.0  # time.monotonic() (system-wide on Linux)
    backend_cpu_s: float = 0.0
    backends: int = 0
    client_cpu_s: float = 0.0
    error: str | None = None


def _pass_worker(
    side: str,
    dsn: str,
    batch: int,
    ready: Any,
    start: Any,
    results: multiprocessing.Queue[WorkerResult],
) -> None:
    result = WorkerResult()
    meter = BackendCpu()
    try:
        ready.release()
        start.wait()
        # The process's CPU clock: os.times() counts whole 10 ms ticks, a tenth of a pass's
        # client CPU.
        cpu_started = time.process_time()
        if side == "product":
            result.projects = product_drain(dsn, meter)
        else:
            result.projects = baseline_drain(dsn, batch, meter)
        result.finished = time.monotonic()
        result.client_cpu_s = time.process_time() - cpu_started
    except BaseException:
        result.error = traceback.format_exc()
    result.backend_cpu_s, result.backends = meter.seconds, meter.backends
    results.put(result)


def run_pass(side: str, dsn: str, workers: int, batch: int) -> dict[str, Any]:
    """One pass: `workers` processes (forked before the clock starts) drain the whole queue."""
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Semaphore(0), ctx.Event()
    results: multiprocessing.Queue[WorkerResult] = ctx.Queue()
    procs = [
        ctx.Process(target=_pass_worker, args=(side, dsn, batch, ready, start, results))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    started = time.monotonic()
    start.set()
    found = [results.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [r.error for r in found if r.error]
    if errors:
        raise RuntimeError(f"{side} drain failed:\n" + "\n".join(errors))
    projects = sum(r.projects for r in found)
    wall = max(r.finished for r in found) - started
    backend = sum(r.backend_cpu_s for r in found)
    client = sum(r.client_cpu_s for r in found)
    return {
        "projects": projects,
        "seconds": round(wall, 3),
        "projects_per_s": round(projects / wall, 1),
        "backend_cpu_ms_per_project": round(backend / projects * 1000, 3),
        "client_cpu_ms_per_project": round(client / projects * 1000, 3),
        "per_worker": [r.projects for r in found],
        "backends": sum(r.backends for r in found),
    }


def prepare_pass(dsn: str, workload: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in PREPARE[workload]:
            conn.execute(statement)
    make_due(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in VACUUM:
            conn.execute(statement)


class Agreement:
    """The two databases compared after each pair of passes: aggregates, versions, an empty
    queue, and the events written since the last comparison."""

    def __init__(self, dsns: dict[str, str]) -> None:
        self.dsns = dsns
        self.last_event = dict.fromkeys(dsns, 0)

    def check(self, label: str) -> dict[str, int]:
        """Events per topic written since the last check (the same on both sides)."""
        seen: dict[str, Any] = {}
        for side, dsn in self.dsns.items():
            with psycopg.connect(dsn) as conn:
                queued = conn.execute(
                    "SELECT count(*) FROM chessboard.project_recalc_requests"
                ).fetchone()[0]  # type: ignore[index]
                assert queued == 0, f"{label}: {queued} projects left in {side}'s queue"
                rows = conn.execute(
                    "SELECT id, topic, message_key, (payload - 'EventId' - 'CreatedAt')::text,"
                    " payload ? 'EventId' AND payload ? 'CreatedAt', traceparent, defect"
                    " FROM chessboard.outbox_events WHERE id > %s",
                    (self.last_event[side],),
                ).fetchall()
                if rows:
                    self.last_event[side] = max(r[0] for r in rows)
                seen[side] = {
                    "aggregates": actual_aggregates(conn),
                    "versions": versions(conn),
                    "events": Counter(tuple(r[1:]) for r in rows),
                }
        product, baseline = seen["product"], seen["baseline"]
        for what in ("aggregates", "versions", "events"):
            if product[what] != baseline[what]:
                raise AssertionError(
                    f"{label}: the baseline's {what} differ from the product's: "
                    + _first_difference(product[what], baseline[what])
                )
        topics: Counter[str] = Counter()
        for (topic, _key, _payload, envelope, traceparent, defect), n in product["events"].items():
            assert envelope and traceparent is None and defect is None, (topic, defect)
            topics[topic] += n
        return dict(sorted(topics.items()))


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, Counter):
        return f"only in the product {list((a - b).items())[:3]}, only in the baseline" + (
            f" {list((b - a).items())[:3]}"
        )
    for table in a:
        for key, value in a[table].items():
            if b[table].get(key) != value:
                return f"{table} {key}: product {value}, baseline {b[table].get(key)}"
    return "row sets differ"


def round_trips(dsns: dict[str, str], batch: int) -> dict[str, Any]:
    """Per project, in one tick of each side traced by libpq (PQtrace): round trips (a simple
    Query, or an extended-protocol Sync, each waits for the server once) and COMMIT statements
    (the product's statements run in autocommit and commit on their own: one per project). The
    rest of the queue is drained untraced afterwards."""
    out: dict[str, Any] = {}
    for side, dsn in dsns.items():
        make_due(dsn)
        with tempfile.NamedTemporaryFile("w+", suffix=".trace") as trace:

            @contextmanager
            def traced(conn: psycopg.Connection) -> Iterator[None]:
                conn.pgconn.trace(trace.fileno())
                try:
                    yield
                finally:
                    conn.pgconn.untrace()

            if side == "product":
                with product_connections(traced):
                    projects = len(drain_tick(dsn).results)
            else:
                with psycopg.connect(dsn, autocommit=True) as conn, traced(conn):
                    projects = baseline_tick(conn, batch)
            trace.seek(0)
            sent = re.findall(r"^[^\t]*\tF\t\d+\t(Query|Sync)\b(.*)$", trace.read(), re.M)
        out[side] = {
            "projects": projects,
            "round_trips_per_project": round(len(sent) / projects, 2),
            "commit_statements_per_project": round(
                sum(1 for kind, rest in sent if kind == "Query" and '"COMMIT"' in rest) / projects,
                2,
            ),
        }
        if side == "product":
            drain_all(dsn)
        else:
            baseline_drain(dsn, batch, BackendCpu())
    return out


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def cpu_per_project(product: dict[str, Any]) -> float:
    """The product's CPU ms per project in a pass or a summary: its drains' and their
    backends'."""
    return float(product["backend_cpu_ms_per_project"] + product["client_cpu_ms_per_project"])


def scale_out(row: dict[str, Any]) -> tuple[float, list[float]]:
    """A workload's CPU per project with 2 workers / with 1: of the rounds' medians, and of each
    round's two passes."""
    one, two = (row[f"workers_{k}"] for k in (1, 2))
    by_round = [
        round(cpu_per_project(b) / cpu_per_project(a), 3)
        for a, b in zip(one["per_round"]["product"], two["per_round"]["product"], strict=True)
    ]
    return round(cpu_per_project(two["product"]) / cpu_per_project(one["product"]), 3), by_round


def compare_with_baseline(
    args: argparse.Namespace, workloads: list[str], progress: Callable[[str], None]
) -> dict[str, Any]:
    dsns = setup_pair(args.projects, args.objects, args.batch)
    agreement = Agreement(dsns)
    for side, dsn in dsns.items():  # the first drain writes and publishes every row
        prepare_pass(dsn, "steady")
        first = run_pass(side, dsn, 1, args.batch)
        progress(f"first drain, {side}: {first['projects_per_s']} projects/s")
    first_events = agreement.check("first drain")
    runs: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {
        w: {k: {s: [] for s in SIDES} for k in (1, 2)} for w in workloads
    }
    events: dict[str, dict[str, int]] = {}
    order = 0
    for round_no in range(1, args.rounds + 1):
        for workload in workloads:
            # 1-2 in odd rounds, 2-1 in even ones: a machine whose costs drift during the run
            # (they moved by 14-28 % between runs of one morning) weighs on both worker counts
            # alike instead of on whichever always ran second.
            for workers in (1, 2) if round_no % 2 else (2, 1):
                sides = SIDES if order % 2 == 0 else SIDES[::-1]
                order += 1
                for side in sides:
                    prepare_pass(dsns[side], workload)
                    found = run_pass(side, dsns[side], workers, args.batch)
                    assert found["projects"] == args.projects, found
                    runs[workload][workers][side].append(found)
                    progress(
                        f"round {round_no} {workload} workers={workers} {side}:"
                        f" {found['projects_per_s']} projects/s,"
                        f" backend {found['backend_cpu_ms_per_project']} ms CPU/project,"
                        f" client {found['client_cpu_ms_per_project']} ms"
                    )
                events[workload] = agreement.check(f"round {round_no} {workload} x{workers}")
    truth: dict[str, Any] = {}
    if args.truth == "yes" or (args.truth == "auto" and args.projects <= 300):
        for side, dsn in dsns.items():
            with psycopg.connect(dsn) as conn:
                drifted = drift(conn)
            assert not drifted, f"{side} drifted from the truth: {str(drifted)[:500]}"
            truth[side] = "no drift"
    else:
        truth["skipped"] = "--truth auto skips it above 300 projects (Python truth is O(n^2))"
    out: dict[str, Any] = {
        "projects": args.projects,
        "objects_per_project": args.objects,
        "batch": args.batch,
        "rounds": args.rounds,
        "first_drain_events": first_events,
        "truth": truth,
        "agreement": "aggregates, versions, queue and events identical after every pass pair",
    }
    for workload in workloads:
        row: dict[str, Any] = {
            "events_per_project": round(sum(events[workload].values()) / args.projects, 2)
        }
        for workers in (1, 2):
            measured = runs[workload][workers]
            summary: dict[str, Any] = {}
            for side in SIDES:
                summary[side] = {
                    key: median([r[key] for r in measured[side]])
                    for key in (
                        "projects_per_s",
                        "backend_cpu_ms_per_project",
                        "client_cpu_ms_per_project",
                    )
                }
            product, baseline = summary["product"], summary["baseline"]
            summary["throughput_ratio"] = round(
                product["projects_per_s"] / baseline["projects_per_s"], 3
            )
            summary["backend_cpu_ratio"] = round(
                product["backend_cpu_ms_per_project"] / baseline["backend_cpu_ms_per_project"], 3
            )
            summary["per_round"] = {
                side: [
                    {
                        k: r[k]
                        for k in (
                            "projects_per_s",
                            "backend_cpu_ms_per_project",
                            "client_cpu_ms_per_project",
                            "per_worker",
                        )
                    }
                    for r in measured[side]
                ]
                for side in SIDES
            }
            row[f"workers_{workers}"] = summary
        out[workload] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--projects", type=int, help="projects of the throughput sections (1000; --quick: 300)"
    )
    parser.add_argument("--objects", type=int, default=50, help="objects per project")
    parser.add_argument("--batch", type=int, default=50, help="projects per tick, both sides")
    parser.add_argument(
        "--rounds", type=int, default=4, help="product/baseline and 1/2 workers alternating"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-latency", action="store_true", help="skip section 1")
    parser.add_argument("--no-pgbench", action="store_true", help="skip section 3")
    parser.add_argument(
        "--truth", choices=("auto", "yes", "no"), default="auto", help="auto: at <= 300 projects"
    )
    args = parser.parse_args()
    if args.projects is None:
        args.projects = 300 if args.quick else 1000
    workloads = [w for w in args.workloads.split(",") if w]
    assert workloads and set(workloads) <= set(WORKLOADS), args.workloads
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "bench": "recalc",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    if not args.no_latency:
        sizes = [100, 1000] if args.quick else [100, 1_000, 10_000, 50_000]
        reps = 10 if args.quick else 50
        result["recompute_latency_by_objects"] = latency(
            fresh_database("pin_bench_recalc"), sizes, reps
        )
        progress("latency done")

    comparison = compare_with_baseline(args, workloads, progress)
    result["vs_baseline"] = comparison
    result["ratio_vs_baseline"] = {
        w: {
            f"workers_{k}": {
                "throughput": comparison[w][f"workers_{k}"]["throughput_ratio"],
                "backend_cpu": comparison[w][f"workers_{k}"]["backend_cpu_ratio"],
            }
            for k in (1, 2)
        }
        for w in workloads
    }

    # Scale-out by cost: CPU-seconds per project, the drains' and their backends',
    # with 2 workers against 1; it does not depend on spare cores, as projects/s does.
    scale = {w: scale_out(comparison[w]) for w in workloads}
    result["scale_out_cpu_ratio"] = {w: ratio for w, (ratio, _) in scale.items()}
    result["scale_out_cpu_ratio_by_round"] = {w: by_round for w, (_, by_round) in scale.items()}
    result["goals"] = {"ratio_vs_baseline_min": 1.0, "scale_out_cpu_ratio_max": 1.15}
    result["round_trips"] = round_trips(
        {side: dsn_with_dbname(BASE_DSN, f"pin_bench_{side}") for side in SIDES}, args.batch
    )
    if not args.no_pgbench:
        # The drain against pgbench running the drain's own statements, steady state, on the
        # product's database (its drain figures are this run's steady passes).
        product = dsn_with_dbname(BASE_DSN, "pin_bench_product")
        try:
            pg = {k: pgbench_throughput(product, k, args.projects, args.batch) for k in (1, 2)}
        except subprocess.CalledProcessError as exc:
            # Not worth the run's other figures (e.g. recalc.sql edited during the run).
            result["pgbench_error"] = (exc.stderr or "").strip().splitlines()[-2:]
            pg = {}
        if pg:
            result["pgbench_projects_per_s"] = {f"clients_{k}": round(v, 1) for k, v in pg.items()}
        if pg and "steady" in workloads:
            drained = {
                k: comparison["steady"][f"workers_{k}"]["product"]["projects_per_s"] for k in (1, 2)
            }
            result["drain_projects_per_s"] = {f"workers_{k}": v for k, v in drained.items()}
            result["ratio_vs_pgbench"] = {
                f"workers_{k}": round(drained[k] / pg[k], 3) for k in (1, 2)
            }
        progress("pgbench done")
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
