"""The read API's connections to the dimension, shared by its request threads.

A client of the project's ClickHouse interface serves one statement at a time, so the API keeps
a few and lends each to one request at a time:

- on a server (`clickhouse://`), SERVER_CONNECTIONS clients, each a connection of its own: that
  many reads run at once, and the server sees no more from one API process than that;
- on the embedded engine (`chdb://`), EMBEDDED_CONNECTIONS clients, every one opened as a folder
  owner would be (`serve=True`): the API is a long-lived process like the continuous loader
  (clickhouse/owner.py). While a loader owns the folder each client has a socket of its own to
  it (the owner answers each on a thread); when that loader stops, one of them takes the folder
  over (the owner lock decides) and answers the next loader, and the others share its session
  (chdb shares a folder within a process). Never `serve=False`: such a client may open the
  folder without serving it in the instant between two owners, and then keep every loader out.
  A client's statements are serial (one session or one socket), so the second lets two reads
  run at once (measured with 4 threads on a loaded machine: 81 labels reads/s with one client,
  119 with two, 106 with four).

A request that finds every client lent for CHECKOUT_SECONDS is refused (503), not queued
without bound.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from pin_pipelines.clickhouse import (
    ClickHouse,
    ClickHouseUnavailable,
    open_clickhouse,
    parse_clickhouse_url,
)

#: Concurrent reads of one API process on a ClickHouse server: its reads take milliseconds, so a
#: few cover the 2 cores of a small deployment; more would only move the queue to the server.
SERVER_CONNECTIONS = 4
#: Clients on the embedded engine: a chdb read is CPU-bound (~6 ms of CPU per labels read of 100
#: ids), so two keep the 2 cores of the development machine busy; more only contend.
EMBEDDED_CONNECTIONS = 2
#: How long a request waits for a free client before it is answered 503.
CHECKOUT_SECONDS = 10.0


class ClickHousePool:
    """Clients of one PIN_CLICKHOUSE_URL, lent one request at a time (use as a context manager)."""

    def __init__(
        self,
        url: str,
        *,
        connections: int = SERVER_CONNECTIONS,
        opener: Callable[..., ClickHouse] = open_clickhouse,
        password_file: Path | None = None,
    ) -> None:
        embedded = isinstance(parse_clickhouse_url(url), Path)
        self.size = EMBEDDED_CONNECTIONS if embedded else connections
        self._clients: list[ClickHouse] = []
        self._idle: queue.LifoQueue[ClickHouse] = queue.LifoQueue()
        try:
            for _ in range(self.size):
                client = opener(url, serve=embedded, password_file=password_file)
                self._clients.append(client)
                self._idle.put(client)
        except BaseException:
            self.close()
            raise
        #: Where the dimension is, for messages (no credentials): a folder or host:port.
        self.location = self._clients[0].location

    @contextmanager
    def client(self, timeout: float = CHECKOUT_SECONDS) -> Iterator[ClickHouse]:
        """A client for one request. A server client reconnects by itself after a network
        error, and the embedded one re-attaches to the folder's owner, so every client goes
        back to the pool whatever its statement did."""
        try:
            client = self._idle.get(timeout=timeout)
        except queue.Empty:
            raise ClickHouseUnavailable(
                f"all {self.size} ClickHouse clients of the read API were busy for {timeout:g}s"
            ) from None
        try:
            yield client
        finally:
            self._idle.put(client)

    def close(self) -> None:
        """The clients in reverse order: on chdb the first one opened is the one that may own
        the folder, and it goes last, once no other session of this process holds the folder
        (the next owner can open it then)."""
        for client in reversed(self._clients):
            client.close()
        self._clients.clear()

    def __enter__(self) -> ClickHousePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
