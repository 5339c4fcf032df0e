"""Continuous loaders as real processes (`pin devstats load` without --once), each aimed at a
topic, group and DLQ topic of its test: the contract topic and the loader's group are shared by
every test session on the broker. Their settings (`loader_env`), the stored versions of groups read
through whichever loader owns an embedded folder (`versions`), and a bounded wait (`wait_for`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pin_pipelines.clickhouse import open_clickhouse, owner, parse_clickhouse_url
from pin_pipelines.devstats.dim import stored_versions
from pin_pipelines.devstats.loader import LoadOptions
from tests.support.devstats import Group

#: `pin devstats load` (cli.main) with the loader aimed at argv's topic, group and DLQ topic (and,
#: for the partition tests, a shorter bound for rejoining its group).
LOADER = """
import dataclasses, os, sys
from pin_pipelines.devstats import loader
topic, group, dlq_topic = sys.argv[1:4]
if os.environ.get("PIN_TEST_JOIN_TIMEOUT"):
    loader.JOIN_TIMEOUT = float(os.environ["PIN_TEST_JOIN_TIMEOUT"])
real = loader.load_continuously
def aimed(settings, options):
    options = dataclasses.replace(options, topic=topic, group=group, dlq_topic=dlq_topic)
    return real(settings, options)
loader.load_continuously = aimed
from pin_pipelines.cli import main
sys.exit(main(["devstats", "load"]))
"""


class LoaderProcess:
    """A running loader; its stdout and stderr go to files (a full pipe would block it)."""

    def __init__(
        self, options: LoadOptions, env: dict[str, str], logs: Path, name: str, *, deaf: bool
    ) -> None:
        """`deaf`: started with SIGTERM and SIGINT ignored, as a supervisor may leave them."""
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-c", LOADER, options.topic, options.group, options.dlq_topic],
                env={**os.environ, **env},
                stdout=out,
                stderr=err,
                text=True,
                preexec_fn=_ignore_stop_signals if deaf else None,
            )

    def stop(self, timeout: float = 30.0) -> tuple[dict[str, Any], float]:
        """SIGTERM; its JSON summary (the last stdout line) and how long it took to exit 0."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        took = time.monotonic() - sent
        assert code == 0, f"exit {code}: {self.err.read_text()[-2000:]}"
        return json.loads(self.out.read_text().strip().splitlines()[-1]), took

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


@contextmanager
def loaders(
    options: LoadOptions, env: dict[str, str], logs: Path
) -> Iterator[Callable[..., LoaderProcess]]:
    """Start loader processes by name; every one is killed and waited for at the end."""
    started: list[LoaderProcess] = []

    def start(name: str, deaf: bool = False) -> LoaderProcess:
        started.append(LoaderProcess(options, env, logs, name, deaf=deaf))
        return started[-1]

    try:
        yield start
    finally:
        for loader in started:
            loader.kill()


def loader_env(
    clickhouse_url: str, kafka_bootstrap: str, pg_dsn: str, state: Path
) -> dict[str, str]:
    return {
        "PIN_CLICKHOUSE_URL": clickhouse_url,
        "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "PIN_PG_DSN": pg_dsn,
        "PIN_STATE_DIR": str(state),
    }


def versions(clickhouse_url: str, groups: list[Group]) -> dict[uuid.UUID, int]:
    """The stored (argMax) version of each group that has one; a client opened for this read.

    An embedded folder is read only through the loader that owns it, waiting (up to 60 s)
    while none answers (one starting, or the milliseconds of a hand-over). Opened here instead,
    the folder would be taken from a loader that is starting, and a worker that holds another
    folder (another module's) cannot open it: chdb opens one folder per process. Each open and
    close also leaves chdb threads and their descriptors behind in this process (a CI worker
    polling so ran out of select()'s 1,024)."""
    target = parse_clickhouse_url(clickhouse_url)
    if isinstance(target, Path):
        wait_for_an_owner(target, 60)
    with open_clickhouse(clickhouse_url) as ch:
        found = stored_versions(ch, [g.id for g in groups])
    return {g.id: found[g.id.int] for g in groups if g.id.int in found}


def wait_for_an_owner(folder: Path, timeout: float) -> None:
    """Until a process owns the embedded folder and answers on its socket."""
    deadline = time.monotonic() + timeout
    while (conn := owner.connect(folder)) is None:
        assert time.monotonic() < deadline, f"no loader owns {folder} within {timeout:g}s"
        time.sleep(0.05)
    conn.close()


def wait_for(what: str, done: Callable[[], bool], timeout: float) -> float:
    """Seconds until `done()`; fails after `timeout`."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, f"{what} within {timeout:g}s"
        time.sleep(0.05)
    return time.monotonic() - started


#: `stored_groups`' child: the (LayoutGroupId, SourceVersion) of a developer's groups as JSON.
STORED_GROUPS = """
import json, sys, uuid
from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.devstats.dim import groups
with open_clickhouse(sys.argv[1]) as ch:
    found = groups(ch, uuid.UUID(sys.argv[2]))
print(json.dumps([[str(g.layout_group_id), g.source_version] for g in found]))
"""


def stored_groups(clickhouse_url: str, developer: uuid.UUID) -> set[tuple[uuid.UUID, int]]:
    """The (LayoutGroupId, SourceVersion) of `developer`'s groups, read in a child process: an
    embedded folder no loader holds any more can be opened in this process only while it holds
    no other folder, and under the parallel lanes an earlier module of the worker may hold the
    session's (`chdb_url`)."""
    found = json_from_child(STORED_GROUPS, clickhouse_url, str(developer))
    return {(uuid.UUID(gid), int(version)) for gid, version in found}


def json_from_child(script: str, *args: str) -> Any:
    """What `script`, run with `args` in a child Python with the repository on its path, printed
    as JSON: a read of an embedded folder that this process cannot open (it holds another)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)
