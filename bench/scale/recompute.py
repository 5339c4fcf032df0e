"""The recalc phase: recompute latency by project size, drain throughput with 1 and 2 workers, and
CPU-seconds per recalculated project, each in both catalogues."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any
from uuid import UUID

import psycopg
from _common import drain_throughput, log, quantiles
from _cpu import CpuMeter

from pin_pipelines.recalc.drain import drain_tick

from .databases import Q

#: The goal: a large project's recompute latency (p50 and p99) at most this times the baseline's.
LATENCY_RATIO_GOAL = 1.5


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


def baseline_mixes(
    dsns: dict[str, str], classes: dict[str, dict[int, list[UUID]]]
) -> dict[str, list[UUID]]:
    """The same mix of project sizes in each database: as many projects of each class as the
    baseline has."""
    return {
        label: [
            p
            for size, members in classes[label].items()
            for p in members[: len(classes["baseline"][size])]
        ]
        for label in dsns
    }


def measure_recalc(
    dsns: dict[str, str],
    classes: dict[str, dict[int, list[UUID]]],
    meter: Callable[[], CpuMeter],
    samples: int,
    distinct: int,
    rounds: int,
) -> dict[str, Any]:
    """The phase's report sections: recompute latency by size, drain throughput, CPU per
    project."""
    out: dict[str, Any] = {
        "recompute_latency_by_size": recompute_latency(dsns, classes, samples, distinct)
    }
    mixes = baseline_mixes(dsns, classes)
    log("throughput", projects=len(mixes["large"]))
    out["drain_throughput"] = throughput(dsns, mixes, rounds)
    log("cpu per project")
    out["recompute_cpu_by_size"] = recompute_cpu(dsns, classes, meter)
    return out
