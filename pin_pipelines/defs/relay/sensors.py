"""Keeps one relay run going: launches one when none is in flight, and its successor shortly
before the run in flight spends its budget (the hand-over, see jobs.py)."""

from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.sensors import Backlog, long_run_sensor
from pin_pipelines.relay import relay_lag


def _outbox_backlog(settings: Settings) -> Backlog:
    """One relay at a time (the relay lock): the backlog never asks for a second run; the
    successor waits on the lock for the rest of the run in flight (less than its 60 s
    lock_timeout)."""
    with connection(settings.pg_dsn) as conn:
        backlog = relay_lag(conn)
    return Backlog(tags={"pin/outbox_pending": str(backlog["pending"])})


outbox_relay_sensor = long_run_sensor(
    name="outbox_relay_sensor",
    job=outbox_relay_job,
    op="relay_outbox",
    noun="relay run",
    description="Keeps outbox_relay_job running: one relay run, and its successor near its end.",
    read_backlog=_outbox_backlog,
    unreadable="outbox unreadable",
)
