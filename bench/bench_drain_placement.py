"""Where a drain and its PostgreSQL backend run: two CPUs or one.

bench_recalc's 2-worker cells put four busy processes on this machine's 2 cores, so every drain
shares a CPU with some backend, and the product and the plain baseline react to that in opposite
ways. This measures it with one worker and nothing else moving: the drain process and its
backend pinned (`sched_setaffinity`) to two different CPUs ("apart") or to the same one
("together"), each side draining the same steady queue on one connection (the product: ticks of
`tick_on`, as a drain run does; the baseline: `baseline_tick`); then two workers, each with its
backend on a CPU of its own ("paired"): every drain shares its CPU with a backend, as "together",
so `paired_over_together` (CPU per project, backends' and drains') is what a second worker costs
once placement is the same for one worker and two. Reported per side and placement:
backend CPU ms per project (its CPU clock), the drain's CPU ms per project (user and system from
getrusage), its voluntary and involuntary context switches per project, and projects/s.

The two databases are bench_recalc's (`setup_pair`, then a first drain each), so a run of this
leaves them as bench_recalc does.

    .venv/bin/python bench/bench_drain_placement.py [--projects 1000] [--objects 50]
        [--batch 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cpu import process_cpu_seconds
from bench_recalc import SIDES, baseline_tick, prepare_pass, run_pass, setup_pair

from pin_pipelines.recalc import drain

#: One worker with its backend on two CPUs or on one; two workers, each with its backend on a CPU
#: of its own ("paired": the placement of "together" for each, so that what a second worker adds
#: is measured apart from where the processes run).
PLACEMENTS = ("apart", "together", "paired")


def _drain_queue(side: str, conn: psycopg.Connection, batch: int) -> int:
    done = 0
    while True:
        found = (
            len(drain.tick_on(conn).results) if side == "product" else baseline_tick(conn, batch)
        )
        if not found:
            return done
        done += found


def pinned_drain(
    side: str, dsn: str, cpus: tuple[int, int], batch: int, start: Any = None
) -> dict[str, float]:
    """One worker in this process on CPU cpus[0], its backend on cpus[1], draining until the
    queue is empty; `start` (a multiprocessing Barrier) lines up the workers of a pair. Raw
    totals: projects, seconds, CPU-seconds of the backend and of the drain (user, system),
    context switches."""
    connect = drain.drain_connection if side == "product" else _autocommit
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        with connect(dsn) as conn:
            backend = conn.info.backend_pid
            os.sched_setaffinity(backend, {cpus[1]})
            if start is not None:
                start.wait()
            backend_started = process_cpu_seconds(backend) or 0.0
            usage_started = resource.getrusage(resource.RUSAGE_SELF)
            started = time.monotonic()
            projects = _drain_queue(side, conn, batch)
            wall = time.monotonic() - started
            usage = resource.getrusage(resource.RUSAGE_SELF)
            backend_cpu = (process_cpu_seconds(backend) or 0.0) - backend_started
    finally:
        os.sched_setaffinity(0, own)
    return {
        "projects": projects,
        "seconds": wall,
        "backend_cpu": backend_cpu,
        "client_user": usage.ru_utime - usage_started.ru_utime,
        "client_system": usage.ru_stime - usage_started.ru_stime,
        "voluntary_switches": usage.ru_nvcsw - usage_started.ru_nvcsw,
        "involuntary_switches": usage.ru_nivcsw - usage_started.ru_nivcsw,
    }


def _paired_worker(side: str, dsn: str, cpu: int, batch: int, start: Any, out: Any) -> None:
    """One worker of a pair; a failure goes to `out` as its one line, and breaks the barrier so
    that the other worker does not wait for it."""
    try:
        out.put(pinned_drain(side, dsn, (cpu, cpu), batch, start))
    except Exception as exc:
        start.abort()
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def pinned_pass(side: str, dsn: str, placement: str, batch: int) -> dict[str, Any]:
    """One steady pass in `placement`: one worker in this process, or two forked ones."""
    prepare_pass(dsn, "steady")
    if placement == "paired":
        ctx = multiprocessing.get_context("fork")
        start, out = ctx.Barrier(2, timeout=60), ctx.Queue()
        workers = [
            ctx.Process(target=_paired_worker, args=(side, dsn, cpu, batch, start, out))
            for cpu in (0, 1)
        ]
        for worker in workers:
            worker.start()
        found = [out.get(timeout=600) for _ in workers]
        for worker in workers:
            worker.join()
        errors = [f["error"] for f in found if "error" in f]
        if errors:
            raise RuntimeError(f"{side} paired drain failed: " + "; ".join(errors))
    else:
        found = [pinned_drain(side, dsn, (0, 0 if placement == "together" else 1), batch)]
    projects = sum(f["projects"] for f in found)

    def per_project(key: str, scale: float = 1000.0) -> float:
        return round(sum(f[key] for f in found) / projects * scale, 3)

    return {
        "projects": projects,
        "projects_per_s": round(projects / max(f["seconds"] for f in found), 1),
        "backend_cpu_ms_per_project": per_project("backend_cpu"),
        "client_user_ms_per_project": per_project("client_user"),
        "client_system_ms_per_project": per_project("client_system"),
        "voluntary_switches_per_project": per_project("voluntary_switches", 1),
        "involuntary_switches_per_project": per_project("involuntary_switches", 1),
    }


def _autocommit(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


def _cost(found: dict[str, Any]) -> float:
    """CPU per project, the backend's and the drain's."""
    return (
        found["backend_cpu_ms_per_project"]
        + found["client_user_ms_per_project"]
        + found["client_system_ms_per_project"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projects", type=int, default=1000)
    parser.add_argument("--objects", type=int, default=50, help="objects per project")
    parser.add_argument("--batch", type=int, default=50, help="projects per tick, both sides")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_drain_placement: needs 2 CPUs to place the processes apart")
    result: dict[str, Any] = {
        "bench": "drain_placement",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    dsns = setup_pair(args.projects, args.objects, args.batch)
    for side, dsn in dsns.items():  # the first drain writes and publishes every row
        prepare_pass(dsn, "steady")
        run_pass(side, dsn, 1, args.batch)
    passes: dict[str, dict[str, list[dict[str, Any]]]] = {
        side: {placement: [] for placement in PLACEMENTS} for side in SIDES
    }
    for _ in range(args.rounds):
        for side in SIDES:
            for placement in PLACEMENTS:
                found = pinned_pass(side, dsns[side], placement, args.batch)
                assert found["projects"] == args.projects, found
                passes[side][placement].append(found)
                print(side, placement, found, file=sys.stderr, flush=True)
    result["passes"] = passes
    result["together_over_apart"] = {
        side: {
            key: round(
                sum(p[key] for p in passes[side]["together"])
                / sum(p[key] for p in passes[side]["apart"]),
                3,
            )
            for key in ("backend_cpu_ms_per_project", "client_user_ms_per_project")
        }
        for side in SIDES
    }
    result["paired_over_together"] = {
        side: round(
            sum(map(_cost, passes[side]["paired"])) / sum(map(_cost, passes[side]["together"])), 3
        )
        for side in SIDES
    }
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
