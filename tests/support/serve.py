"""`pin serve` as the tests run it: on an instance of its own (a Dagster home, a storage database
and a port), in a session of its own so that everything it started can be found and killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError
from dagster_shared.error import SerializableErrorInfo

from pin_pipelines.config import dagster_pg_url_from
from pin_pipelines.stack.process import free_port
from tests.support.pg import dbname
from tests.support.recalc import PIN, REPO_ROOT


def storage_url(dagster_db: str) -> str:
    """The Dagster storage URL of the database `dagster_db` (a DSN; the dagster_db fixture)."""
    return dagster_pg_url_from(dagster_db, dbname(dagster_db))


def serve_env(
    *,
    pg_dsn: str,
    dagster_db: str,
    kafka_bootstrap: str,
    clickhouse_url: str,
    home: Path,
    **settings: str,
) -> dict[str, str]:
    """The environment of a private `pin serve` on a free port; `settings` adds PIN_* variables."""
    return {
        **os.environ,
        "PIN_PG_DSN": pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "DAGSTER_HOME": str(home),
        "PIN_DAGSTER_PG_URL": storage_url(dagster_db),
        "PIN_DAGSTER_PORT": str(free_port()),
        "PIN_CLICKHOUSE_URL": clickhouse_url,
        **settings,
    }


def instance_env(
    *, pg_dsn: str, dagster_db: str, kafka_bootstrap: str, tmp_path: Path, **settings: str
) -> dict[str, str]:
    """`serve_env` of an instance under `tmp_path`: its Dagster home, and an embedded dimension
    of its own (chdb admits one process per folder)."""
    return serve_env(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka_bootstrap,
        clickhouse_url=f"chdb://{tmp_path / 'chdb'}",
        home=tmp_path / "dagster_home",
        **settings,
    )


def migrated_instance(
    *, pg_dsn: str, dagster_db: str, kafka_bootstrap: str, tmp_path: Path
) -> dict[str, str]:
    """`instance_env`, migrated by `pin db migrate`."""
    env = instance_env(
        pg_dsn=pg_dsn, dagster_db=dagster_db, kafka_bootstrap=kafka_bootstrap, tmp_path=tmp_path
    )
    subprocess.run([PIN, "db", "migrate"], cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    return env


def start_serve(
    env: dict[str, str],
    log: Path,
    *,
    pin: str = PIN,
    cwd: Path = REPO_ROOT,
    command: str = "serve",
) -> subprocess.Popen[bytes]:
    """`pin serve` (this release's, or another release's `pin` in its own tree `cwd`; `pin dev`
    with `command="dev"`) with its stderr in `log`, the leader of a new session: `kill_session`
    then finds it and everything it started."""
    return subprocess.Popen(
        [pin, command],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )


def session_table(sid: int) -> dict[int, tuple[int, str]]:
    """The live processes of session `sid` (`pin serve` and everything it started), from /proc:
    parent pid and command line by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), command)
    return found


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid` as `pid: command line`."""
    return [f"{pid}: {command}" for pid, (_, command) in session_table(sid).items()]


def code_servers(sid: int) -> dict[int, tuple[int, str]]:
    """The code servers (`dagster api grpc`) of session `sid`, as `session_table` lists them."""
    return {pid: row for pid, row in session_table(sid).items() if " api grpc " in row[1]}


def session_pids(sid: int) -> list[int]:
    """The pids of `session_processes(sid)`."""
    return [int(line.split(":", 1)[0]) for line in session_processes(sid)]


#: How long kill_session goes on killing what the session starts meanwhile.
KILL_SESSION_SECONDS = 10.0


def kill_session(sid: int) -> None:
    """SIGKILL to every process of the session (`pin serve` runs the Dagster processes in a
    process group of their own, so a group's kill does not reach them), again until none is
    left: a process forked while the others were killed (a run worker its code server was
    starting) is in the session too, and once its parents are gone nothing else would end it
    (one outlived test_handover so)."""
    deadline = time.monotonic() + KILL_SESSION_SECONDS
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def submit_run(client: DagsterGraphQLClient, job: str) -> bool:
    """Submit a run of `job` through the webserver, as a schedule's tick submits one; False
    while its code location is still loading (or once the webserver is stopping)."""
    try:
        client.submit_job_execution(job)
    except DagsterGraphQLClientError:
        return False
    return True


def failure_messages(event: dg.DagsterEvent) -> list[str]:
    """A step's or a run's failure, cause by cause."""
    if event.is_step_failure:
        return _error_messages(event.step_failure_data.error)
    return _error_messages(getattr(event.event_specific_data, "error", None))


def _error_messages(error: SerializableErrorInfo | None) -> list[str]:
    """What a step failure says, cause by cause, without the stacks (a stack's tail hid the
    Kafka error of a CI failure)."""
    messages = []
    while error is not None:
        messages.append(error.message.strip())
        error = error.cause
    return messages
