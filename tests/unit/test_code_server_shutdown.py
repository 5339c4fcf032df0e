"""A Dagster code server told to shut down ends, also when the storage of a run process that
exited cannot be opened (pin_pipelines/defs/code_server.py): a real DagsterApiServer, no code
loaded, no service needed (the run's instance lives in a folder that cannot be made, which fails
at once where a dropped PostgreSQL database fails after the connection's retries)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dagster._core.instance.ref import InstanceRef
from dagster._core.utils import FuturesAwareThreadPoolExecutor
from dagster._grpc.server import DagsterApiServer

from pin_pipelines.defs import code_server

#: The server is told to shut down by its missed heartbeats after this long.
HEARTBEAT_TIMEOUT = 1
#: It ends within this long once told (its cleanup thread ticks every 0.5 s).
ENDS_WITHIN = 10.0


@dataclass
class ExitedRunProcess:
    """A run worker that has exited (what the cleanup thread asks of a multiprocessing.Process)."""

    exitcode: int = 1

    def is_alive(self) -> bool:
        return False


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[DagsterApiServer, threading.Event, float]]:
    """A code server with a heartbeat and no code, which started one run whose process has
    exited and whose storage cannot be opened (as a dropped storage database); and when it was
    made (its heartbeat clock starts then: a test that read the clock later, on a loaded CI
    worker, saw the server end 0.99 s after its own reading)."""
    code_server.harden()
    home = tmp_path / "dagster_home"
    home.mkdir()
    ref = InstanceRef.from_dir(str(home))
    home.rmdir()
    home.write_text("")  # its storage folders can no longer be made: the instance fails to open
    terminated = threading.Event()
    executor = FuturesAwareThreadPoolExecutor(max_workers=2)
    made = time.monotonic()
    server = DagsterApiServer(
        server_termination_event=terminated,
        logger=logging.getLogger("test.code_server"),
        server_threadpool_executor=executor,
        heartbeat=True,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        lazy_load_user_code=True,
    )
    with server._execution_lock:
        server._executions["run"] = (ExitedRunProcess(), ref)  # type: ignore[assignment]
        server._termination_events["run"] = threading.Event()  # type: ignore[assignment]
    try:
        yield server, terminated, made
    finally:
        terminated.set()  # ends its cleanup thread, if still running
        server.cleanup()
        executor.shutdown(wait=False)


def test_dagsters_own_check_raises_on_the_unreachable_storage(
    server: tuple[DagsterApiServer, threading.Event, float],
) -> None:
    """The cause: the check the cleanup thread runs raises, uncaught in that thread, which then
    ends, and nothing else ever sets the termination event."""
    api, _, _ = server
    original = getattr(DagsterApiServer._check_for_orphaned_runs, "__wrapped__", None)
    original = original or DagsterApiServer._check_for_orphaned_runs
    with pytest.raises(FileExistsError):
        original(api)


def test_a_code_server_told_to_shut_down_ends_despite_the_storage_error(
    server: tuple[DagsterApiServer, threading.Event, float],
) -> None:
    """Tried without the wrap (Dagster 1.13.27 as it is): the heartbeat timeout passed, the
    cleanup thread died on the storage error ("Exception in thread grpc-server-cleanup") and the
    termination event was never set. With it: set within ENDS_WITHIN, the exited run cleared."""
    api, terminated, made = server
    assert terminated.wait(ENDS_WITHIN), "the code server never ended"
    assert time.monotonic() - made >= HEARTBEAT_TIMEOUT  # told by its heartbeat, not sooner
    assert api._executions == {}


def test_harden_wraps_once() -> None:
    code_server.harden()
    wrapped = DagsterApiServer._check_for_orphaned_runs
    code_server.harden()
    assert DagsterApiServer._check_for_orphaned_runs is wrapped
    assert not getattr(wrapped.__wrapped__, "_pin_hardened", False)  # type: ignore[attr-defined]
