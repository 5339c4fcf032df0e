"""`pin serve` and `pin dev` killed with SIGKILL, the way an operator's `kill -9 <pid>` kills them:
nothing they started outlives them.

A SIGKILL gives `pin serve` no chance to stop its children. Its dagster-daemon and
dagster-webserver run in a process group of their own (so that Ctrl-C reaches `pin serve` alone),
so nothing else reached them either: they, their code servers and their run workers were
reparented to init and went on running, on the instance, with nothing left to stop them (a code
server whose parent is gone is meant to end on its missed heartbeats, and does not while a run
worker of its own runs, nor ever once its cleanup thread has died: the issue of a code server
found running 51 minutes after the test that started it).

The Kafka broker is this module's own (test_relay_exactly_once's fixture): the load run joins the
loader's consumer group, which on the shared broker other `pin serve`s use.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.serve import (
    kill_session,
    migrated_instance,
    session_processes,
    start_serve,
    submit_run,
)

#: Everything of the killed `pin serve` must be gone within this long (the run workers in flight
#: included: they are killed, not waited for; run monitoring fails their runs at the next start).
GONE_SECONDS = 30.0
#: A short run submitted through the webserver once the code location is loaded.
JOB = "recalc_poison_check_job"
#: What runs below `pin serve` (`pin dev`: under `dagster dev`) when it is killed: the daemon, the
#: webserver, a code server and a run worker (the sensors' relay and load runs, 5 minutes each).
EXPECTED = {
    "serve": ("dagster-daemon run", "dagster-webserver", "api grpc", "multiprocessing.spawn"),
    "dev": ("dagster dev", "dagster._daemon run", "dagster_webserver", "api grpc", "spawn_main"),
}


@pytest.mark.parametrize("command", ["serve", "dev"])
def test_kill_9_of_pin_serve_leaves_nothing_of_it_running(
    command: str,
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried on the code before the fix: `pin serve` (and `pin dev`) on its own instance, its
    code location loaded, a run submitted through the webserver and started, the relay and load
    runs of its sensors in flight; SIGKILL to its pid alone. 30 s later its daemon, webserver,
    both code servers, their resource trackers and the run workers were all still running
    (reparented to init), and went on until the test killed its session. Now every process of
    its session is gone within GONE_SECONDS."""
    env = migrated_instance(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka.settings.kafka_bootstrap,
        tmp_path=tmp_path,
    )
    home = Path(env["DAGSTER_HOME"])
    client = DagsterGraphQLClient("127.0.0.1", port_number=int(env["PIN_DAGSTER_PORT"]))
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", env["PIN_DAGSTER_PG_URL"])
    log = tmp_path / "serve.log"
    serve = start_serve(env, log, command=command)
    try:
        wait_until(lambda: submit_run(client, JOB), timeout=180, what=f"a {JOB} run", logfile=log)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            wait_until(
                lambda: bool(
                    instance.get_run_records(
                        dg.RunsFilter(
                            job_name=JOB,
                            statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.SUCCESS],
                        )
                    )
                ),
                timeout=120,
                what=f"the {JOB} run launched",
                logfile=log,
            )
        wait_until(
            lambda: all(
                any(e in p for p in session_processes(serve.pid)) for e in EXPECTED[command]
            ),
            timeout=60,
            what="a run worker",
            logfile=log,
        )
        before = session_processes(serve.pid)
        os.kill(serve.pid, signal.SIGKILL)  # `kill -9 <pid>`: `pin serve` alone
        serve.wait(timeout=10)
        killed = time.monotonic()
        while session_processes(serve.pid) and time.monotonic() - killed < GONE_SECONDS:
            time.sleep(0.2)
        left = session_processes(serve.pid)
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)
    assert left == [], (
        f"alive {GONE_SECONDS:g}s after `kill -9` of `pin {command}`: "
        + "; ".join(line[:160] for line in left)
        + f" (of {len(before)} before the kill)"
    )
