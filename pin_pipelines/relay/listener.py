"""The relay's wake-up: a PostgreSQL session of its own that LISTENs for the outbox trigger's
notification, sent at the commit of every transaction that wrote the outbox
(outbox_events_notify, sql/postgres/schema/outbox.sql).

The relay waits on it between runs instead of polling the outbox, and polls only as a backstop
(PIN_RELAY_BACKSTOP_SECONDS): for a notification lost with the session (the server restarted,
failed over, or ended the backend), which is why a lost session also wakes the relay once it is
listening again. No wait is unbounded: each one is a slice of the relay's idle wait, a lost
session is reported in one line and connected again within a connect timeout, at most once per
RECONNECT_SECONDS while PostgreSQL is away.
"""

from __future__ import annotations

import logging
import select
import time

import psycopg

from pin_pipelines.db import connect, queries
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.logs import log_event
from pin_pipelines.sql_faces import OutboxQueries

Q = queries("outbox", OutboxQueries)

#: While PostgreSQL is away, how often the listening session is tried again.
RECONNECT_SECONDS = 1.0

#: The listening session idles by design: a server-wide idle_session_timeout must not end it
#: (each end would cost a reconnect and a log line). Named for pg_stat_activity.
LISTENER_SESSION = {"application_name": "pin-outbox-listener", "idle_session_timeout": "0"}

log = logging.getLogger("pin_pipelines.relay")


class OutboxListener:
    """`listen` before the relay's first look at the outbox (a commit between that look and
    the wait then still wakes it), `wait` between runs, `close` at the end."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection | None = None
        #: The session's socket, registered once: poll, not select, which refuses a descriptor
        #: numbered 1024 or more (a CI run's relay, in a process holding many, failed so).
        self._readable = select.poll()
        self._socket: int | None = None
        self._listen_again_at = 0.0

    def __enter__(self) -> OutboxListener:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._readable.unregister(self._socket)
            self._socket = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def listen(self) -> bool:
        """Open the session and LISTEN; False when PostgreSQL is unreachable (the relay's own
        session fails and says so; `wait` tries again)."""
        self._listen_again_at = time.monotonic() + RECONNECT_SECONDS
        try:
            conn = connect(self.dsn, autocommit=True, session=LISTENER_SESSION)
        except PinError:
            return False
        try:
            Q.listen_outbox(conn)
        except psycopg.Error:
            conn.close()
            return False
        self._socket = conn.fileno()
        self._readable.register(self._socket, select.POLLIN)
        self._conn = conn
        return True

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for a commit that wrote the outbox. True when one came (with
        the others already queued: one relay run covers them all), and when the session was
        lost or is back: a commit meanwhile may have had no notification, so the relay looks."""
        conn = self._conn
        if conn is None:
            if time.monotonic() >= self._listen_again_at and self.listen():
                return True
            time.sleep(seconds)
            return False
        try:
            # poll the socket, then read: psycopg's notifies(timeout=…) costs six times the CPU
            # of a poll per call, and an idle relay makes twenty a second.
            if not self._readable.poll(seconds * 1000):
                return False
            if not list(conn.notifies(timeout=0)):
                return False  # not a notification (yet): a closed session raises next time
        except psycopg.Error as exc:
            log_event(
                log,
                "relay_listener_lost",
                level=logging.WARNING,
                error=first_line(exc),
                then="listening again; the backstop poll covers what was committed meanwhile",
            )
            self.close()
            self.listen()
        return True
