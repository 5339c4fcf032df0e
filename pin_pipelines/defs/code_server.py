"""A Dagster code server that ends when it is told to, also after a storage error.

Dagster 1.13's code server (`dagster api grpc`: the one `pin serve` runs, serve.py; before, those
of the daemon and the webserver) ends through one path only: its cleanup thread, every 0.5 s,
`DagsterApiServer._check_for_orphaned_runs`, which, for each run process that has exited, opens
the instance from the run's instance ref and reads the run (to report a crash), and sets the
server's termination event once a shutdown was asked for (ShutdownServer, or no heartbeat for
the heartbeat timeout) and no run process is left. An exception there (the storage unreachable,
or its database dropped) ends the thread, uncaught: from then on nothing ever sets the event, and
the server, told to shut down, runs on for good. A CI run left one running 51 minutes after its
test (the browser test's daemon exited while the run worker of its last run was still exiting,
and the next test's fixture dropped the storage database under it); in `pin serve`, a PostgreSQL
failover while a run worker exits left a code server behind at each reload of the daemon's
(every 60 s), until the next stop.

`harden()` wraps that check: an error is logged (once per outage) and the check is tried again
at the next tick, so a run process that exited is still reported once the storage answers; a
server told to shut down clears the run processes that have exited without their report (run
monitoring reports them) and ends. The same upstream: dagster-io/dagster issue 32226 (a code
server's shutdown hung for 32 h after a metadata database failover).

Applied by pin_pipelines.definitions, which every code server of the project imports while it
starts, before its cleanup thread does (the method is looked up at each tick anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dagster._grpc.server import DagsterApiServer

_HARDENED = "_pin_hardened"


def harden() -> None:
    """Wrap DagsterApiServer._check_for_orphaned_runs (once)."""
    original: Callable[[Any], None] = DagsterApiServer._check_for_orphaned_runs
    if getattr(original, _HARDENED, False):
        return

    def check_for_orphaned_runs(server: Any) -> None:
        try:
            original(server)
        except Exception:
            if not getattr(server, "_pin_check_failing", False):
                server._logger.exception(
                    "pin: the check of the code server's run processes failed; tried again "
                    "every 0.5 s (a shutdown goes ahead without it)"
                )
            server._pin_check_failing = True
            if server._shutdown_once_executions_finish_event.is_set():
                with server._execution_lock:
                    for run_id, (process, _ref) in list(server._executions.items()):
                        if not process.is_alive():
                            server._clear_run(run_id)
                    if not server._executions:
                        server._server_termination_event.set()
        else:
            server._pin_check_failing = False

    setattr(check_for_orphaned_runs, _HARDENED, True)
    check_for_orphaned_runs.__wrapped__ = original  # type: ignore[attr-defined]
    DagsterApiServer._check_for_orphaned_runs = check_for_orphaned_runs  # type: ignore[method-assign,assignment]
