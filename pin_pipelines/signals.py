"""SIGTERM and SIGINT for pin's long-running commands: handled explicitly, whatever dispositions
the process inherited.

An ignored signal stays ignored across fork and exec, and Python installs its KeyboardInterrupt
handler only when SIGINT is not ignored at startup. So a parent that ignores SIGTERM or SIGINT (a
supervisor, a shell's background job, a test process in which Dagster copied an ignored SIGINT onto
SIGTERM) used to start a `pin metrics serve` that only SIGKILL could stop. A caught signal is reset
to its default by exec, so whatever a command starts after installing its handlers (the Dagster
processes of `pin serve`) starts with the default dispositions too.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_requested() -> Callable[[], bool]:
    """Install SIGTERM and SIGINT handlers that only set a flag; returns the flag's reader.

    A flag, not an exception: the command stops at a point of its choosing (the drain after the
    project in hand, the exporter after closing its socket, `pin serve` after its children).
    Main thread only, like every `signal.signal`.
    """
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    return lambda: stopping


def default_stop_signals() -> None:
    """SIGTERM and SIGINT back to their defaults, in a child before it execs a service (`pin
    stack up`): a service started by a supervisor that ignores them could then only be stopped
    with SIGKILL, since an inherited SIG_IGN survives the exec."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
