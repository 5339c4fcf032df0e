"""Samples of the pipeline under load (every minute in the soak: the watched tables, the queue and
the outbox, the drain, the databases' sessions) and the soak's verdict on them."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import psycopg

from .databases import Q

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
    "chessboard.recalc_outcomes",
    "chessboard.recalc_worker_ticks",
    "chessboard.outbox_topic_stats",
)


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
