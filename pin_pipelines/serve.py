"""`pin serve`: dagster-daemon and dagster-webserver on the project's instance, as in production."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from pin_pipelines.config import SOURCE_ROOT, Settings, with_dead_peer_bounds
from pin_pipelines.dagster_instance import TEMPLATE, write_instance_yaml
from pin_pipelines.db import connect
from pin_pipelines.defs.common import IN_FLIGHT, STOPPING_MARKER
from pin_pipelines.errors import PinError
from pin_pipelines.signals import default_stop_signals, stop_requested


def prepare_dagster_home(settings: Settings) -> dict[str, str]:
    """DAGSTER_HOME gets the repository's dagster.yaml with the drain runs' limit from the
    settings (dagster_instance.py); returns the child environment. A DAGSTER_HOME that is the
    repository itself keeps its dagster.yaml as it is: then the sensor alone applies the limit."""
    home = settings.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if TEMPLATE.resolve() != target.resolve():
        write_instance_yaml(settings, target)
    # Fail here, clearly, rather than in two child processes' tracebacks.
    connect(settings.dagster_pg_url.replace("postgresql+psycopg2:", "postgresql:", 1)).close()
    return {
        **os.environ,
        "DAGSTER_HOME": str(home),
        # Every daemon, webserver, code server and run worker connection to the storage is
        # bounded like the project's own (a blackholed server is an error, not a 15-minute hang).
        "PIN_DAGSTER_PG_URL": with_dead_peer_bounds(settings.dagster_pg_url),
        "PIN_PG_DSN": settings.pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "PIN_CLICKHOUSE_URL": settings.clickhouse_url,
    }


def _bin(name: str) -> str:
    sibling = Path(sys.executable).with_name(name)
    found = str(sibling) if sibling.exists() else shutil.which(name)
    if not found:
        raise PinError(f"{name} is not installed (pip install -e .)")
    return found


WORKSPACE = str(SOURCE_ROOT / "workspace.yaml")
#: How long a stop waits for the runs in flight: a stop ends a drain after its project in hand,
#: a relay after its batch in hand, a load after its batch in hand.
WIND_DOWN_SECONDS = 60.0
UNFINISHED = [*IN_FLIGHT, dg.DagsterRunStatus.CANCELING]


def _ui_args(settings: Settings) -> list[str]:
    """Workspace and loopback address shared by dagster-webserver and dagster dev."""
    return ["-w", WORKSPACE, "-h", "127.0.0.1", "-p", str(settings.dagster_port)]


def serve(settings: Settings) -> None:
    """Run both until SIGTERM or SIGINT (then stop them), or until one of them exits.

    The handlers go in before the children start, so the children start with SIGTERM and SIGINT
    at their defaults even when this process inherited them ignored (see pin_pipelines.signals).
    """
    env = prepare_dagster_home(settings)
    marker = settings.dagster_home / STOPPING_MARKER
    marker.unlink(missing_ok=True)  # left by a stop that did not finish
    stopping = stop_requested()
    commands = {
        "dagster-daemon": [_bin("dagster-daemon"), "run", "-w", WORKSPACE],
        "dagster-webserver": [_bin("dagster-webserver"), *_ui_args(settings)],
    }
    children = {
        name: subprocess.Popen(argv, env=env, cwd=SOURCE_ROOT) for name, argv in commands.items()
    }
    print(
        f"pin: Dagster UI on http://127.0.0.1:{settings.dagster_port} "
        f"(DAGSTER_HOME={env['DAGSTER_HOME']}); Ctrl-C stops both",
        file=sys.stderr,
    )
    try:
        while not stopping() and all(child.poll() is None for child in children.values()):
            time.sleep(0.5)
        if stopping() and all(child.poll() is None for child in children.values()):
            _wind_down(settings, env, marker)
    finally:
        marker.unlink(missing_ok=True)
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    if not stopping():
        for name, child in children.items():
            if child.returncode not in (None, 0, -signal.SIGTERM):
                raise PinError(f"{name} exited with code {child.returncode}")


@contextmanager
def open_instance(
    settings: Settings, env: dict[str, str] | None = None
) -> Iterator[dg.DagsterInstance]:
    """The project's Dagster instance in this process (`pin dagster prune`, a clean stop)."""
    env = env or prepare_dagster_home(settings)
    os.environ.update(env)  # the instance's dagster.yaml reads its storage URL from the env
    with dg.DagsterInstance.from_config(str(settings.dagster_home)) as instance:
        yield instance


def _wind_down(settings: Settings, env: dict[str, str], marker: Path) -> None:
    """A clean stop: no new runs (the marker stops the sensors, and drains end after the project
    in hand), then wait for the runs in flight, queued ones included, which the still-running
    daemon launches and monitors. Only then are the daemon and the webserver stopped, so no run
    is left launching on a code server that is shutting down (a FAILURE for a clean stop).
    Bounded: past WIND_DOWN_SECONDS the daemon is stopped anyway and run monitoring settles
    whatever was left when the instance next runs."""
    marker.touch()
    print("pin: stopping: no new runs; waiting for the runs in flight", file=sys.stderr)
    deadline = time.monotonic() + WIND_DOWN_SECONDS
    with open_instance(settings, env) as instance:
        while instance.get_run_records(dg.RunsFilter(statuses=UNFINISHED), limit=1):
            if time.monotonic() > deadline:
                print(
                    f"pin: runs still in flight after {WIND_DOWN_SECONDS:g}s; stopping anyway",
                    file=sys.stderr,
                )
                return
            time.sleep(0.5)


def dagster_dev(settings: Settings) -> None:
    """`dagster dev` on the project's instance: it reads ./dagster.yaml, which needs the
    environment that prepare_dagster_home builds. Replaces this process."""
    env = prepare_dagster_home(settings)
    argv = [_bin("dagster"), "dev", *_ui_args(settings)]
    os.chdir(SOURCE_ROOT)
    default_stop_signals()
    os.execve(argv[0], argv, env)
