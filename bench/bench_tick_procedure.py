"""A drain tick as one server-side procedure call: the next lever of issue 27, measured alone.

The product's drain makes 1.16 round trips per project (`bench_recalc`'s `round_trips`): a
statement per project, `recalc_project_step`, which also claims the next one. Every round trip
wakes the drain's Python, and with 2 workers on 2 cores that Python shares its CPU with a
backend (`bench_drain_placement`: its user CPU doubles), which is where `bench_recalc`'s
`scale_out_cpu_ratio` exceeds 1.15. This runs the same per-project statement from a procedure,
`bench_tick.tick` (bench/sql/tick_procedure.sql): a tick per CALL, a COMMIT per project, the
results returned as one JSON array; the client turns each into the drain's ProjectResult and
its log line, as the product does. Both drains run on the same database, alternating (the kind
going first and the worker count 1-2 / 2-1 alternate by round), and every pass must recalculate
every project and write as many events as the product's pass of the same workload.

Reported per workload, drain and worker count (medians of the rounds): projects/s, backend and
client CPU ms per project; the procedure's CPU per project over the product's; and each drain's
scale-out by cost (2 workers / 1, bench_recalc's `scale_out_cpu_ratio`).

What the prototype leaves out, and what building it into the product would take:
  - Stops between projects: a CALL runs its whole tick. The drain would bound each CALL by time
    (stop claiming after a fraction of a second) so a stop is still obeyed between calls, and
    catch a cancel inside the procedure to give the claim in hand back and return the projects
    already committed (their log lines and spans are otherwise lost with the error).
  - statement_timeout: it covers the whole CALL (a COMMIT inside a procedure does not re-arm
    it), so the per-project bound would become the call's bound plus its claiming window.
  - The per-project span: its traceparent is stamped into the events by the work itself, so the
    span ids must be chosen before the CALL (an OpenTelemetry IdGenerator handing out preset
    ids) and the spans written afterwards from the server's start and end times.
  - A lock wait on the claimed row (LockNotAvailable) leaves recalc_project_step as an error and
    would abort the whole CALL: it must be caught per project inside the procedure.

    .venv/bin/python bench/bench_tick_procedure.py [--projects 1000] [--objects 50]
        [--batch 50] [--rounds 4] [--workloads steady,edited,rewrite]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import BENCH_SQL, fresh_database
from bench_recalc import (
    PASS_DRAINS,
    WORKLOADS,
    BackendCpu,
    cpu_per_project,
    insert_projects,
    median,
    prepare_pass,
    run_pass,
)

from pin_pipelines.logs import log_event
from pin_pipelines.recalc import drain

KINDS = ("product", "procedure")
TICK_SQL = BENCH_SQL / "tick_procedure.sql"
TICK_CALL = "CALL bench_tick.tick(%s, %s, %s, NULL)"


def procedure_drain(dsn: str, batch: int, meter: BackendCpu) -> int:
    """Ticks of `bench_tick.tick` on one drain connection (the drain's session settings) until
    one finds nothing due; each project's result becomes a ProjectResult and its log line."""
    traceparents: list[str | None] = [None] * batch  # tracing is off in bench_recalc too
    outcomes: Counter[str] = Counter()
    with drain.drain_connection(dsn) as conn:
        try:
            while True:
                row = conn.execute(
                    TICK_CALL,
                    (batch, traceparents, drain.LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT),
                    prepare=True,
                ).fetchone()
                assert row is not None
                found = row[0]
                if not found:
                    break
                for project in found:
                    result = _project_result(project)
                    outcomes[result.outcome] += 1
                    log_event(
                        drain.log,
                        "project_recalculated",
                        project_id=str(result.project_id),
                        duration_seconds=round(result.duration_seconds, 4),
                        republished=result.republished,
                    )
        finally:
            meter.add(conn)
    assert set(outcomes) == {"recalculated"}, outcomes
    return outcomes["recalculated"]


def _project_result(project: list[Any]) -> drain.ProjectResult:
    (
        project_id,
        outcome,
        duration,
        buildings,
        layouts,
        groups,
        projects,
        _error,
        _attempts,
        requested,
        _waited,
    ) = project
    return drain.ProjectResult(
        UUID(project_id),
        outcome,
        duration,
        republished={"layout": layouts or 0, "layout_group": groups or 0, "project": projects or 0},
        buildings_updated=buildings or 0,
        requested_count=requested,
    )


def events_written(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()
    assert row is not None
    return int(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--projects", type=int, default=1000)
    parser.add_argument("--objects", type=int, default=50, help="objects per project")
    parser.add_argument("--batch", type=int, default=50, help="projects per tick, both drains")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    assert workloads and set(workloads) <= set(WORKLOADS), args.workloads
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "bench": "tick_procedure",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "projects": args.projects,
        "objects_per_project": args.objects,
        "batch": args.batch,
        "rounds": args.rounds,
    }
    dsn = fresh_database("pin_bench_tick")
    insert_projects(dsn, args.projects, args.objects)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TICK_SQL.read_text())
    PASS_DRAINS["procedure"] = procedure_drain
    prepare_pass(dsn, "steady")
    run_pass("product", dsn, 1, args.batch)  # the first drain writes and publishes every row
    runs: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {
        w: {kind: {1: [], 2: []} for kind in KINDS} for w in workloads
    }
    for round_no in range(1, args.rounds + 1):
        for workload in workloads:
            events: dict[str, list[int]] = {kind: [] for kind in KINDS}
            for kind in KINDS if round_no % 2 else KINDS[::-1]:
                for workers in (1, 2) if round_no % 2 else (2, 1):
                    prepare_pass(dsn, workload)
                    before = events_written(dsn)
                    found = run_pass(kind, dsn, workers, args.batch)
                    assert found["projects"] == args.projects, found
                    events[kind].append(events_written(dsn) - before)
                    runs[workload][kind][workers].append(found)
                    progress(
                        f"round {round_no} {workload} {kind} workers={workers}:"
                        f" {found['projects_per_s']} projects/s,"
                        f" backend {found['backend_cpu_ms_per_project']} ms CPU/project,"
                        f" client {found['client_cpu_ms_per_project']} ms"
                    )
            assert len({n for ns in events.values() for n in ns}) == 1, (workload, events)
    for workload in workloads:
        row: dict[str, Any] = {}
        for kind in KINDS:
            row[kind] = {
                f"workers_{k}": {
                    key: median([r[key] for r in runs[workload][kind][k]])
                    for key in (
                        "projects_per_s",
                        "backend_cpu_ms_per_project",
                        "client_cpu_ms_per_project",
                    )
                }
                for k in (1, 2)
            }
            one, two = (cpu_per_project(row[kind][f"workers_{k}"]) for k in (1, 2))
            row[kind]["scale_out_cpu_ratio"] = round(two / one, 3)
        for k in (1, 2):
            procedure, product = (row[kind][f"workers_{k}"] for kind in ("procedure", "product"))
            row[f"procedure_over_product_workers_{k}"] = {
                "cpu_per_project": round(cpu_per_project(procedure) / cpu_per_project(product), 3),
                "projects_per_s": round(procedure["projects_per_s"] / product["projects_per_s"], 3),
            }
        result[workload] = row
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
