"""Idle cost of `pin serve`: every local service at rest, nothing edited. Prints ONE JSON line
(progress on stderr).

    .venv/bin/python bench/bench_idle.py [--settle 60] [--window SECONDS] [--baseline DIR]

`pin serve` runs on a catalogue database of its own (--database, default pin_lean_idle, loaded
with `pin sample load` as `bin/up` does), its own Dagster storage database (<database>_dagster),
DAGSTER_HOME, embedded ClickHouse folder and Kafka broker: a broker of this run, since the
loader's consumer group has a fixed name (joining the shared broker's group would take partitions
from whoever else loads there) and since the broker's own CPU and memory are part of the budget.
PostgreSQL is the shared server: only the backends of the two databases count, and their
transactions from `pg_stat_database`.

After start-up (the UI answers) and a settle minute (the sample's drain and relay done), over the
window (default PIN_LONG_RUN_SECONDS + 30 s of the code measured: a hand-over of each of the
relay and the load falls in any window longer than a run), reported:

- `cpu_percent_of_one_core` and `rss_mib` (mean over the window, and the max) by role, from
  /proc: `pin serve` (with its sweeper), the daemon, the webserver, code servers, run workers by
  job, the broker, the PostgreSQL backends of each database;
- `transactions_per_s` (xact_commit + xact_rollback) and `sessions_per_minute` of each database;
- `processes_started` during the window, by command (run workers by job);
- the long runs' hand-overs in the window: each successor's launch latency (created → started)
  and its overlap with its predecessor (> 0: no gap), and the run workers' start cost
  (CPU-seconds from the process's start to the run's start);
- `event_log_rows` of the long runs that ended: rows per run and per minute of run.

With --baseline DIR (a checkout of the code to compare with, e.g. `git archive main`), the same
phase runs first on that code (the whole phase, broker configuration included, imported from
DIR), then on this tree's; the line holds both and the ratios after/before.

Not counted: this script's own CPU; a process that lives less than SAMPLE_SECONDS may be missed,
and the CPU a process uses after its last sample (at most SAMPLE_SECONDS' worth) is lost, which
undercounts the short-lived backends of a connection per storage call (Dagster's storage holds no
pool in the daemon): `sessions_per_minute` counts them all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BASE_DSN, fresh_database, load_average, log
from _cpu import postmaster_pid, proc_children, proc_cmdline, proc_stat
from scale.databases import drop_database
from scale.services import Private

from pin_pipelines.config import SOURCE_ROOT, Settings, dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.stack.process import port_open, stop_child

#: Tracked processes (and the server's new backends) are read this often.
SAMPLE_SECONDS = 0.05
#: Resident memory is read this often (a status file per process).
RSS_SECONDS = 2.0
#: A child still showing its parent's command line (forked, not yet exec'd) is looked at again
#: this many times before it counts as what its parent is (a multiprocessing fork).
EXEC_GRACE_SAMPLES = 20
#: The long-lived jobs whose runs hand over.
LONG_JOBS = ("outbox_relay_job", "dim_layout_group_job")
STARTED_PROCESS = re.compile(r"Started process for run \(pid: (\d+)\)")


def role_of(command: str, parent_role: str | None) -> str:
    """What a process of `pin serve` is, from its command line and its parent's role."""
    if "kafka.Kafka" in command:
        return "kafka"
    if "pin_pipelines.sweeper" in command or command.split()[-2:] == ["pin_pipelines.cli", "serve"]:
        return "pin serve"
    if "dagster-daemon" in command:
        return "daemon"
    if "dagster-webserver" in command:
        return "webserver"
    if " api grpc" in command or "code-server start" in command:
        return "code server"
    if parent_role == "code server" and "spawn_main" in command:
        return "run worker"  # the job is known once its run logs the pid (relabelled later)
    return parent_role or "other"


def short_command(command: str) -> str:
    """A command line without its long arguments: the program and the first words."""
    words = [w for w in command.split() if not w.startswith("-") or w == "-m"][:4]
    return " ".join(Path(w).name if "/" in w else w for w in words)[:80]


@dataclass
class Process:
    pid: int
    parent: int
    started: int  # ticks since boot: with the pid, the process's identity
    role: str
    command: str
    database: str | None = None  # a backend's
    cpu: float = 0.0
    cpu_at_window: float | None = None  # None: started after the window began
    seen_at: float = field(default_factory=time.time)
    cpu_series: list[tuple[float, float]] = field(default_factory=list)  # run workers' (t, cpu)
    rss_kib: dict[int, int] = field(default_factory=dict)  # RSS sample index → KiB
    ended: bool = False


class RoleSampler:
    """Follows `pin serve`'s process tree (and the broker) and the server's backends of
    `databases` from /proc until closed."""

    def __init__(self, roots: dict[int, str], server_pid: int | None, databases: dict[str, str]):
        self.processes: list[Process] = []
        self._live: dict[int, Process] = {}
        self._pending: dict[int, int] = {}
        self._ignored: set[int] = set()
        self._server_pid = server_pid
        self._databases = databases
        self._window: tuple[float, float | None] | None = None
        self.rss_samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for pid, role in roots.items():
            self._track(pid, role, proc_cmdline(pid))
        self._thread = threading.Thread(target=self._run, name="idle-sampler", daemon=True)
        self._thread.start()

    @property
    def window_start(self) -> float:
        return self._window[0] if self._window else 0.0

    def begin_window(self) -> None:
        with self._lock:
            self._window = (time.time(), None)
            for p in self._live.values():
                p.cpu_at_window = p.cpu

    def end_window(self) -> float:
        """Ends the window (the figures stay as they are now); returns its length."""
        self._sample()
        with self._lock:
            assert self._window is not None
            end = time.time()
            self._window = (self._window[0], end)
            return end - self._window[0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _track(self, pid: int, role: str, command: str, database: str | None = None) -> None:
        found = proc_stat(pid)
        if found is None:
            return
        # cpu_at_window stays None for one started in the window: its whole life counts.
        process = Process(pid, found[0], found[2], role, command, database, cpu=found[1])
        self._live[pid] = process
        self.processes.append(process)

    def _run(self) -> None:
        next_rss = time.monotonic()
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()
            if time.monotonic() >= next_rss:
                next_rss += RSS_SECONDS
                self._sample_rss()

    def _sample(self) -> None:
        with self._lock:
            if self._window is not None and self._window[1] is not None:
                return  # the window is over: the figures stay as they were at its end
            now = time.time()
            for pid, p in list(self._live.items()):
                found = proc_stat(pid)
                if found is None or found[2] != p.started:
                    p.ended = True
                    del self._live[pid]
                    continue
                p.cpu = found[1]
                if p.role.startswith("run worker"):
                    p.cpu_series.append((now, p.cpu))
            for parent in [p for p in self._live.values() if p.database is None]:
                for child in proc_children(parent.pid):
                    if child not in self._live:
                        self._examine(child, parent)
            self._scan_backends()

    def _examine(self, pid: int, parent: Process) -> None:
        command = proc_cmdline(pid)
        if not command:
            return
        if command == parent.command:
            seen = self._pending.get(pid, 0) + 1
            self._pending[pid] = seen
            if seen < EXEC_GRACE_SAMPLES:
                return
        self._pending.pop(pid, None)
        self._track(pid, role_of(command, parent.role), command)

    def _scan_backends(self) -> None:
        if self._server_pid is None:
            return
        children = proc_children(self._server_pid)
        self._ignored &= set(children)
        for pid in children:
            if pid in self._live or pid in self._ignored:
                continue
            title = proc_cmdline(pid)
            if not title.startswith("postgres: "):
                continue  # forked, not yet named
            words = title.split()
            database = words[2] if len(words) >= 4 else None
            if title.startswith("postgres: autovacuum worker") and len(words) > 3:
                database = words[3]
            if database in self._databases:
                self._track(pid, f"postgres {self._databases[database]}", title, database)
            else:
                self._ignored.add(pid)

    def _sample_rss(self) -> None:
        with self._lock:
            if self._window is None or self._window[1] is not None:
                return
            index = self.rss_samples
            self.rss_samples += 1
            for p in self._live.values():
                rss = _rss_kib(p.pid)
                if rss is not None:
                    p.rss_kib[index] = rss


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return 0  # a zombie


def database_counters(names: list[str]) -> dict[str, tuple[int, int]]:
    """(transactions ended, sessions opened) of each database so far."""
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname, xact_commit + xact_rollback, sessions FROM pg_stat_database"
            " WHERE datname = ANY(%s)",
            (names,),
        ).fetchall()
    return {name: (int(xacts), int(sessions)) for name, xacts, sessions in rows}


def _pin(env: dict[str, str], *argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pin_pipelines.cli", *argv],
        env=env,
        cwd=SOURCE_ROOT,
        check=True,
        capture_output=True,
    )


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """`pin serve` at rest on this interpreter's code: the figures of one phase."""
    catalogue = args.database
    storage = f"{catalogue}_dagster"
    databases = {catalogue: "catalogue", storage: "dagster storage"}
    with ExitStack() as stack:
        dsn = fresh_database(catalogue)
        stack.callback(drop_database, catalogue)
        with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{storage}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{storage}"')
        stack.callback(drop_database, storage)
        private = Private(stack)
        home = Path(tempfile.mkdtemp(dir=private.root, prefix="dagster_home_"))
        env = {
            **private.env(dsn, "idle"),
            "DAGSTER_HOME": str(home),
            "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn, storage),
            "PIN_DAGSTER_PORT": str(args.port),
        }
        _pin(env, "db", "migrate")
        _pin(env, "sample", "load")
        broker_pid = int(private.kafka().pidfile.read_text())
        with psycopg.connect(dsn) as conn:
            server = postmaster_pid(conn.info.backend_pid)
        serve = subprocess.Popen(
            [sys.executable, "-m", "pin_pipelines.cli", "serve"],
            env=env,
            # The code this interpreter imports (`-m` puts the working directory first).
            cwd=SOURCE_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(private.root / "serve.log", "wb"),  # noqa: SIM115 (closed with the process)
        )
        sampler = RoleSampler({serve.pid: "pin serve", broker_pid: "kafka"}, server, databases)
        try:
            deadline = time.monotonic() + 180
            while not port_open("127.0.0.1", args.port):
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"pin serve did not come up; see {private.root}/serve.log")
                time.sleep(1)
            log("serve up; settling", seconds=args.settle)
            time.sleep(args.settle)
            before = database_counters(list(databases))
            sampler.begin_window()
            log("window", seconds=args.window, load=load_average())
            time.sleep(args.window)
            seconds = sampler.end_window()
            after = database_counters(list(databases))
            runs = _runs(dsn_with_dbname(BASE_DSN, storage))
        finally:
            stop_child(serve, grace_seconds=90)
            sampler.close()
        return _figures(sampler, seconds, databases, before, after, runs)


def _runs(storage_dsn: str) -> dict[str, Any]:
    """From Dagster's storage: each run's job, times and event-log rows, the pid of its run
    worker, and sensor ticks by sensor."""
    with psycopg.connect(storage_dsn) as conn:
        runs = conn.execute(
            "SELECT r.run_id, r.pipeline_name, extract(epoch FROM r.create_timestamp)::float8,"
            "       r.start_time, r.end_time, r.status,"
            "       (SELECT count(*) FROM event_logs e WHERE e.run_id = r.run_id),"
            "       (SELECT e.event FROM event_logs e WHERE e.run_id = r.run_id"
            "          AND e.event LIKE '%%Started process for run%%' LIMIT 1)"
            " FROM runs r ORDER BY r.create_timestamp"
        ).fetchall()
    return {
        "runs": [
            {
                "run_id": run_id,
                "job": job,
                "created": created,
                "started": started,
                "ended": ended,
                "status": status,
                "event_rows": rows,
                "pid": int(m.group(1)) if event and (m := STARTED_PROCESS.search(event)) else None,
            }
            for run_id, job, created, started, ended, status, rows, event in runs
        ]
    }


def _figures(
    sampler: RoleSampler,
    seconds: float,
    databases: dict[str, str],
    before: dict[str, tuple[int, int]],
    after: dict[str, tuple[int, int]],
    found: dict[str, Any],
) -> dict[str, Any]:
    runs = found["runs"]
    job_of_pid = {r["pid"]: r["job"] for r in runs if r["pid"]}
    run_of_pid = {r["pid"]: r for r in runs if r["pid"]}
    window_start = sampler.window_start
    window_end = window_start + seconds

    def role(p: Process) -> str:
        """A run worker by its run's job; a process it started (its own resource tracker, a
        reader of the embedded ClickHouse) under the same job."""
        if p.role != "run worker":
            return p.role
        if p.pid in job_of_pid:
            return f"run worker {job_of_pid[p.pid]}"
        return f"run worker {job_of_pid.get(p.parent, '?')} (child)"

    cpu: dict[str, float] = defaultdict(float)
    rss: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    started: dict[str, int] = defaultdict(int)
    start_costs: dict[str, list[float]] = defaultdict(list)
    for p in sampler.processes:
        if p.cpu_at_window is None and p.seen_at < window_start:
            continue  # ended before the window
        cpu[role(p)] += p.cpu - (p.cpu_at_window or 0.0)
        for index, kib in p.rss_kib.items():
            rss[role(p)][index] += kib
        if p.cpu_at_window is None and p.database is None and p.seen_at <= window_end:
            label = f"{role(p)}: {short_command(p.command)}"
            started[label] += 1
        run = run_of_pid.get(p.pid)
        if run and run["started"] and p.cpu_series and p.cpu_at_window is None:
            # From the process's start to its run's start: imports, instance, resources.
            upto = [c for t, c in p.cpu_series if t <= run["started"] + SAMPLE_SECONDS]
            if upto:
                start_costs[run["job"]].append(upto[-1])
    samples = max(1, sampler.rss_samples)
    total_rss = [sum(rss[r].get(i, 0) for r in rss) for i in range(samples)]
    figures: dict[str, Any] = {
        "window_s": round(seconds, 1),
        "cpu_percent_of_one_core": {
            "total": round(sum(cpu.values()) / seconds * 100, 2),
            **{r: round(c / seconds * 100, 2) for r, c in sorted(cpu.items(), key=lambda x: -x[1])},
        },
        "rss_mib": {
            "total_mean": round(sum(total_rss) / samples / 1024),
            "total_max": round(max(total_rss) / 1024),
            **{
                r: round(sum(v.values()) / samples / 1024)
                for r, v in sorted(rss.items(), key=lambda x: -sum(x[1].values()))
            },
        },
        "transactions_per_s": {
            label: round((after[name][0] - before[name][0]) / seconds, 2)
            for name, label in databases.items()
        },
        "sessions_per_minute": {
            label: round((after[name][1] - before[name][1]) / seconds * 60, 1)
            for name, label in databases.items()
        },
        "processes_started": dict(sorted(started.items())),
        "processes_started_per_minute": round(sum(started.values()) / seconds * 60, 2),
    }
    figures.update(_long_runs(runs, window_start, window_end, start_costs))
    return figures


def _long_runs(
    runs: list[dict[str, Any]],
    window_start: float,
    window_end: float,
    start_costs: dict[str, list[float]],
) -> dict[str, Any]:
    """The hand-overs in the window and what the long runs' event logs hold."""
    handovers = []
    for job in LONG_JOBS:
        ordered = [r for r in runs if r["job"] == job and r["started"]]
        for previous, run in itertools.pairwise(ordered):
            if window_start <= run["created"] <= window_end:
                handovers.append(
                    {
                        "job": job,
                        "launch_latency_s": round(run["started"] - run["created"], 2),
                        # > 0: the successor ran before its predecessor ended (no gap).
                        "overlap_s": round((previous["ended"] or window_end) - run["started"], 2),
                    }
                )
    ended = [r for r in runs if r["job"] in LONG_JOBS and r["ended"] and r["started"]]
    other = [r for r in runs if window_start <= r["created"] <= window_end]
    return {
        "handovers": handovers,
        "runs_created_in_window": dict(
            sorted(
                {
                    job: sum(1 for r in other if r["job"] == job)
                    for job in {r["job"] for r in other}
                }.items()
            )
        ),
        "run_start_cpu_s": {
            job: round(sum(costs) / len(costs), 2) for job, costs in start_costs.items() if costs
        },
        "event_log": {
            job: {
                "rows_per_run": [r["event_rows"] for r in ended if r["job"] == job],
                "rows_per_run_minute": [
                    round(r["event_rows"] / ((r["ended"] - r["started"]) / 60), 2)
                    for r in ended
                    if r["job"] == job
                ],
            }
            for job in LONG_JOBS
        },
    }


def ratios(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float, b: float) -> float | None:
        return round(b / a, 3) if a else None

    return {
        "cpu_total": ratio(
            before["cpu_percent_of_one_core"]["total"], after["cpu_percent_of_one_core"]["total"]
        ),
        "rss_total": ratio(before["rss_mib"]["total_mean"], after["rss_mib"]["total_mean"]),
        **{
            f"transactions_{label}": ratio(before["transactions_per_s"][label], tps)
            for label, tps in after["transactions_per_s"].items()
        },
        "processes_started": ratio(
            before["processes_started_per_minute"], after["processes_started_per_minute"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settle", type=float, default=60.0, help="seconds")
    parser.add_argument(
        "--window",
        type=float,
        # Holds one hand-over of each long run, whatever PIN_LONG_RUN_SECONDS says.
        default=Settings.from_env().long_run_seconds + 30.0,
        help="seconds (default PIN_LONG_RUN_SECONDS + 30)",
    )
    parser.add_argument("--database", default="pin_lean_idle")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PIN_DAGSTER_PORT", 3103)))
    parser.add_argument("--baseline", type=Path, help="the code to compare with (a checkout)")
    parser.add_argument("--phase-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.phase_only or args.baseline is None:
        found = phase(args)
        print(json.dumps({"bench": "idle", **found} if not args.phase_only else found))
        return
    # The baseline's whole phase on its code: this script re-run with the checkout first on
    # the module path (its pin_pipelines, its broker configuration, its dagster.yaml).
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--baseline")
    del argv[i : i + 2]
    log("baseline phase", code=str(args.baseline))
    result = subprocess.run(
        [sys.executable, __file__, *argv, "--phase-only"],
        env={**os.environ, "PYTHONPATH": str(args.baseline.resolve())},
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    before = json.loads(result.stdout.strip().splitlines()[-1])
    log("this tree's phase")
    after = phase(args)
    print(
        json.dumps(
            {"bench": "idle", "before": before, "after": after, "ratio": ratios(before, after)}
        )
    )


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
