"""Thin psycopg 3 access: connections with clear errors, and the named queries of `sql/`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import aiosql
import psycopg

from pin_pipelines.config import SQL_DIR
from pin_pipelines.errors import PinError, first_line

QUERIES_DIR = SQL_DIR / "postgres" / "queries"


def connect(dsn: str, *, autocommit: bool = False, connect_timeout: int = 5) -> psycopg.Connection:
    """Open a connection, turning "server is not there" into a PinError with the address."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=connect_timeout)
    except psycopg.OperationalError as exc:
        raise PinError(f"PostgreSQL at {_redact(dsn)} is unreachable: {first_line(exc)}") from exc


@contextmanager
def connection(dsn: str, *, autocommit: bool = False) -> Iterator[psycopg.Connection]:
    conn = connect(dsn, autocommit=autocommit)
    try:
        yield conn
    finally:
        conn.close()


@cache
def queries(name: str) -> Any:
    """Named queries of `sql/postgres/queries/<name>.sql` (aiosql, psycopg driver)."""
    return aiosql.from_path(QUERIES_DIR / f"{name}.sql", "psycopg")


def _redact(dsn: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return dsn
