"""The E2E-lag phase, and the soak's load: `pin serve` on a catalogue (private Dagster home,
storage database and port) while the edit load runs, sampled every minute in the soak."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from _common import log, seconds_quantiles
from _cpu import CpuMeter

from pin_pipelines.config import dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.stack.process import free_port, port_open, stop_child

from .databases import database_name, storage_database
from .edits import EditLoad, EditResults, edit_load, edit_pool
from .services import Private
from .soak import database_load, minute_row, sample_pipeline, soak_verdict

#: The debounce of recalc_settings (spec 000): an isolated edit waits this long by design.
DEBOUNCE_SECONDS = 30.0


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
            stop_child(serve, grace_seconds=90)
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
    load = EditLoad(
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


def measure_e2e(
    dsns: dict[str, str],
    private: Private,
    meter: Callable[[], CpuMeter],
    rate: float,
    minutes: float,
    warmup_seconds: float,
) -> dict[str, Any]:
    """under_load in each database, in turn, without the per-minute samples."""
    return {
        label: under_load(
            dsn, label, private, meter, rate, minutes, warmup_seconds, per_minute=False
        )
        for label, dsn in dsns.items()
    }
