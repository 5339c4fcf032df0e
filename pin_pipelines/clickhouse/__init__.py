"""ClickHouse for dev-stats: one client over the embedded engine (chdb) and a server (native
protocol).

`open_clickhouse(url)` picks the backend from `PIN_CLICKHOUSE_URL`; `migrate_clickhouse` applies
the DDL in `sql/clickhouse/`, downgraded in one place (`legacy.py`) for Debian's 18.16 server;
`named_queries` reads a query file of `sql/clickhouse/queries/`, and `UuidSet` passes many UUIDs
to `IN` the cheapest way the backend has.
"""

from __future__ import annotations

from pathlib import Path

from pin_pipelines.clickhouse.client import (
    ClickHouse,
    ClickHouseError,
    ClickHouseUnavailable,
    Row,
)
from pin_pipelines.clickhouse.literals import UuidSet
from pin_pipelines.clickhouse.migrate import migrate_clickhouse
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, named_queries
from pin_pipelines.clickhouse.url import DATABASE, ServerAddress, parse_clickhouse_url

__all__ = [
    "CLICKHOUSE_SQL_DIR",
    "DATABASE",
    "ClickHouse",
    "ClickHouseError",
    "ClickHouseUnavailable",
    "Row",
    "ServerAddress",
    "UuidSet",
    "migrate_clickhouse",
    "named_queries",
    "open_clickhouse",
    "parse_clickhouse_url",
]


def open_clickhouse(
    url: str, *, serve: bool = False, password_file: Path | None = None
) -> ClickHouse:
    """A client for `url` (use it as a context manager). The backends import lazily: chdb loads a
    large engine library that a server-only process never needs.

    `serve` matters on the embedded engine only: a long-lived process (the continuous loader)
    keeps the folder open and answers the other processes' statements until it closes
    (`clickhouse/owner.py`); a server needs nothing of the kind. `password_file`
    (PIN_CLICKHOUSE_PASSWORD_FILE) serves a server URL without a password."""
    target = parse_clickhouse_url(url, password_file=password_file)
    if isinstance(target, Path):
        from pin_pipelines.clickhouse.embedded import EmbeddedClickHouse

        return EmbeddedClickHouse(target, serve=serve)
    from pin_pipelines.clickhouse.server import ServerClickHouse

    return ServerClickHouse(target)
