"""The one ClickHouse interface the project codes against; `open_clickhouse` picks the backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from types import TracebackType
from typing import Any

from pin_pipelines.clickhouse.literals import Param
from pin_pipelines.errors import PinError

Row = tuple[Any, ...]


class ClickHouseError(PinError):
    """ClickHouse rejected a statement (bad SQL, wrong types): retrying will not help."""


class ClickHouseUnavailable(PinError):
    """ClickHouse cannot be reached or is busy: the same statement may succeed later."""


class ClickHouse(ABC):
    """A connection to the embedded engine or to a server, with the same results from both.

    Statements name their database (`pin_dev_stats.…`), so they never depend on a default database.
    Result values are Python types: `uuid.UUID`, `int`, `float`, `str`, naive `datetime` (in the
    server's time zone; the project's own servers run in UTC).
    """

    #: Where the data lives, for messages: the chdb folder or `host:port`.
    location: str
    #: How many inserts a writer keeps in flight, each on a connection of its own (opened with
    #: `open_clickhouse` of the same URL): 1 where `send_insert` stores before it returns.
    inserts_in_flight: int = 1

    @abstractmethod
    def command(self, sql: str, params: Mapping[str, Param] | None = None) -> None:
        """Run a statement that returns nothing of interest (DDL, OPTIMIZE, …)."""

    @abstractmethod
    def rows(self, sql: str, params: Mapping[str, Param] | None = None) -> list[Row]:
        """Run a query; `%(name)s` placeholders take escaped literals of `params`."""

    @abstractmethod
    def records(self, sql: str, params: Mapping[str, Param] | None = None) -> list[dict[str, Any]]:
        """`rows`, each by the result's column names (the select's aliases where it gives them):
        for a caller that reads a row by name, not by the position of a column in the select."""

    def insert(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        dedup_token: str | None = None,
    ) -> None:
        """Insert rows in one block and wait until they are stored; a retry with the same
        `dedup_token` is not stored twice (where the engine supports it and the table enables
        non-replicated deduplication)."""
        self.send_insert(table, columns, rows, dedup_token)
        self.confirm_insert()

    @abstractmethod
    def send_insert(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        dedup_token: str | None = None,
    ) -> None:
        """`insert`, returning once the rows are sent: the caller works on while the server
        stores them, and `confirm_insert` (or the next statement) waits for its answer. An engine
        without a round trip to wait on stores them here and now."""

    def confirm_insert(self) -> None:
        """Wait until the rows of `send_insert` are stored, raising the insert's error; nothing
        to do when no insert is pending."""
        return  # engines whose send_insert stores synchronously

    @property
    def deduplicates_inserts(self) -> bool:
        """Whether `insert` honours `dedup_token`; callers skip computing one where it does not."""
        return True

    def sibling(self, host: str, port: int) -> ClickHouse:
        """A client of another server of this one's cluster, as this one's user (TLS and
        password alike): what a statement that runs server by server needs."""
        raise PinError(f"ClickHouse at {self.location} is no server of a cluster")

    @abstractmethod
    def close(self) -> None:
        """Release the connection (the embedded engine's folder lock goes with the process)."""

    @cached_property
    def server_version(self) -> tuple[int, ...]:
        """The engine's version, e.g. (18, 16, 1) for Debian's server, (26, 9, …) for chdb."""
        version = str(self.rows("SELECT version()")[0][0])
        return tuple(int(part) for part in version.split(".") if part.isdigit())

    def __enter__(self) -> ClickHouse:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
