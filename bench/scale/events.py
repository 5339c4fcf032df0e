"""The events phase: every layout group relayed (`pin outbox relay --once`) and loaded (`pin
devstats load --once`) on the private broker and embedded ClickHouse, with the CPU per event, then
`pin reconcile` over the whole catalogue."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from _common import log
from _cpu import CpuMeter

from .catalogue import Shape
from .databases import Q
from .services import Private

#: The goal: the drift check of the whole catalogue within this many seconds, nothing drifted.
RECONCILE_GOAL_SECONDS = 60.0


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


def measure_events(
    dsns: dict[str, str],
    shapes: dict[str, Shape],
    private: Private,
    meter: Callable[[], CpuMeter],
) -> dict[str, Any]:
    """events_and_reconcile in each database, in turn."""
    found = {
        label: events_and_reconcile(dsn, label, private, meter, shapes[label].objects)
        for label, dsn in dsns.items()
    }
    log("reconcile", **{label: r["reconcile"]["seconds"] for label, r in found.items()})
    return found
