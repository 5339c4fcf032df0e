"""The suite's parallel workers (pytest-xdist): what each owns and what they make once together.

Each worker is a pytest process of its own with its own session fixtures; the services of `pin
stack up` are shared, so whatever a worker writes there is named by worker: its test database
(`pin_test_gw0`, …), and through that name its relay identity and Dagster storage. Topics and
consumer groups are already per test (random suffixes). Without xdist (`pytest` alone, one module
with the stack up) the names are today's: `pin_test`.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def worker() -> str | None:
    """This process's xdist worker id (`gw0`, …), or None when pytest runs alone."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def per_worker(name: str) -> str:
    """`name` made this worker's own (`pin_test` → `pin_test_gw1`); unchanged without xdist."""
    found = worker()
    return f"{name}_{found}" if found else name


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run that every worker sees: pytest's base temp of the run (each
    worker's own base temp is a child of it, `popen-gw0`)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker() else base


@contextmanager
def run_lock(tmp_path_factory: pytest.TempPathFactory, what: str) -> Iterator[Path]:
    """Hold the run's lock for `what` (a file lock: a worker that dies inside releases it);
    yields the run folder."""
    folder = run_folder(tmp_path_factory)
    with (folder / f"{what}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def once_per_run(tmp_path_factory: pytest.TempPathFactory, what: str) -> Iterator[bool]:
    """Hold the run's lock for `what`; yields True to the first holder of this run, False to the
    rest (who then find done what the first did). `what` is marked done only when the first
    holder's block ended without an exception, so a failed first try is tried again."""
    with run_lock(tmp_path_factory, what) as folder:
        done = folder / f"{what}.done"
        yield not done.exists()
        done.touch()
