"""`pin serve`'s clean stop as the runs see it: the stopping marker in DAGSTER_HOME, and a
long-lived op's stop (the marker, SIGINT/SIGTERM) with how its run ends then."""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from pin_pipelines.signals import STOP_SIGNALS, stop_requested

#: `pin serve` writes this file into DAGSTER_HOME when it is asked to stop: sensors launch nothing
#: more and a drain ends after the project in hand, and `pin serve` stops the daemon only once no
#: run is in flight, so a clean stop leaves no run in FAILURE. Removed at each start.
STOPPING_MARKER = "pin-serve-stopping"
STOPPING_REASON = "pin serve is stopping: no new runs"


def instance_stopping(instance: dg.DagsterInstance) -> bool:
    return (Path(instance.root_directory) / STOPPING_MARKER).exists()


class RunStop:
    """When a long-lived op (drain, relay, load) should end, and how its run ends then.

    Dagster cancels a run by marking it CANCELING and interrupting its main thread (SIGINT;
    SIGTERM is mapped onto it), which raised DagsterExecutionInterruptedError wherever the op
    happened to be. The same signals also come without any cancel: Ctrl-C in `bin/up`'s
    terminal signals the whole foreground process group, and systemd's default stop every
    process of the unit, run workers included (every such stop used to leave the runs in
    FAILURE). So inside `stopped_by_signal` the signals only set a flag, polled with `pin
    serve`'s stopping marker; the op finishes its project or batch in hand and ends, and
    `end` then raises only when the run was canceled: a signal without a cancel is the
    instance stopping, and the run ends SUCCESS, as on the marker."""

    def __init__(self, context: dg.OpExecutionContext | dg.AssetExecutionContext) -> None:
        self._context = context
        self._signaled: Callable[[], bool] = lambda: False

    def requested(self) -> bool:
        return self._signaled() or instance_stopping(self._context.instance)

    def end(self) -> None:
        """After the op's work and its summary: a canceled run ends canceled."""
        if not self._signaled():
            return
        run = self._context.instance.get_run_by_id(self._context.run.run_id)
        if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
            raise dg.DagsterExecutionInterruptedError()


@contextmanager
def stopped_by_signal(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
) -> Iterator[RunStop]:
    """SIGINT and SIGTERM as RunStop's flag while the block runs; the previous handlers come
    back afterwards. Off the main thread (no signal handlers there) only the marker counts, and
    a cancel interrupts as Dagster does."""
    stop = RunStop(context)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        stop._signaled = stop_requested()
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
