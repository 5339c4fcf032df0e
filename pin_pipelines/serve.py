"""`pin serve`: dagster-daemon and dagster-webserver on the project's instance, as in production."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pin_pipelines.config import SOURCE_ROOT, Settings, dsn_with_dbname
from pin_pipelines.db import connect
from pin_pipelines.errors import PinError


def prepare_dagster_home(settings: Settings) -> dict[str, str]:
    """DAGSTER_HOME holds a copy of the repository's dagster.yaml; returns the child environment."""
    home = settings.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    source = SOURCE_ROOT / "dagster.yaml"
    target = home / "dagster.yaml"
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    # Fail here, clearly, rather than in two child processes' tracebacks.
    connect(dsn_with_dbname(settings.pg_dsn, "dagster")).close()
    return {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PIN_DAGSTER_PG_URL": settings.dagster_pg_url,
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


def _ui_args(settings: Settings) -> list[str]:
    """Workspace and loopback address shared by dagster-webserver and dagster dev."""
    return ["-w", WORKSPACE, "-h", "127.0.0.1", "-p", str(settings.dagster_port)]


def serve(settings: Settings) -> None:
    env = prepare_dagster_home(settings)
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
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stopping and all(child.poll() is None for child in children.values()):
            time.sleep(0.5)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    if not stopping:
        for name, child in children.items():
            if child.returncode not in (None, 0, -signal.SIGTERM):
                raise PinError(f"{name} exited with code {child.returncode}")


def dagster_dev(settings: Settings) -> None:
    """`dagster dev` on the project's instance: it reads ./dagster.yaml, which needs the
    environment that prepare_dagster_home builds. Replaces this process."""
    env = prepare_dagster_home(settings)
    argv = [_bin("dagster"), "dev", *_ui_args(settings)]
    os.chdir(SOURCE_ROOT)
    os.execve(argv[0], argv, env)
