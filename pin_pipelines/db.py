"""Thin psycopg 3 access: connections with clear errors, and the named queries of `sql/`.

One way to reach a named query: a module-level `Q = queries("<file>", <Face>)` in each module
that runs them (the file's typed face, pin_pipelines/sql_faces.py), then `Q.name(conn, ...)` for
counts and writes, or `fetch_one`/`fetch_all`/`fetch_column` when the rows are read, so a row is a
small frozen dataclass read by column name, not a tuple.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import aiosql
import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import class_row, scalar_row

from pin_pipelines.config import PG_CLIENT_DEAD_PEER_PARAMS, SQL_DIR
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.redact import redact_url

QUERIES_DIR = SQL_DIR / "postgres" / "queries"

Row = TypeVar("Row")
Face = TypeVar("Face")
Params = ParamSpec("Params")
#: A named query as its face declares it: the connection, then its parameters.
NamedQuery = Callable[Concatenate[psycopg.Connection, Params], object]


def connect(
    dsn: str,
    *,
    autocommit: bool = False,
    connect_timeout: int = 5,
    session: Mapping[str, str] | None = None,
) -> psycopg.Connection:
    """Open a connection, turning "server is not there" into a PinError with the address. A
    silent server ends it within DEAD_PEER_SECONDS (config.PG_CLIENT_DEAD_PEER_PARAMS, unless
    the DSN sets its own), not after the kernel's retransmission timeout. `session`: settings
    the session starts with (libpq `options`, after the DSN's own; values without spaces), in
    force from its first statement, unlike a SET sent after the connect: a timer the server
    armed with its default at the first statement runs to its end before a new value counts."""
    try:
        params = {**PG_CLIENT_DEAD_PEER_PARAMS, **conninfo_to_dict(dsn)}
        if session:
            options = [str(params.get("options", ""))]
            options += [f"-c {name}={value}" for name, value in session.items()]
            params["options"] = " ".join(o for o in options if o)
        conninfo = make_conninfo("", **params)
        return psycopg.connect(conninfo, autocommit=autocommit, connect_timeout=connect_timeout)
    except psycopg.OperationalError as exc:
        raise connect_failure(dsn, exc) from exc


#: libpq's words for a secured server's refusals (CONTRACT section 8) → what an operator reads
#: first (docs/runbook.md "Secured services" has each one's fix); the server's line follows.
REFUSALS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r'authentication failed for user "(?P<user>[^"]*)"'),
        'authentication failed for user "{user}"',
    ),
    (
        re.compile(r"no password supplied"),
        "no password for the user (none in PIN_PG_DSN nor in its passfile)",
    ),
    (
        re.compile(r"certificate verify failed"),
        "certificate not trusted (sslrootcert does not hold the CA of the server's certificate)",
    ),
    (
        re.compile(r"does not match host name"),
        "the server's certificate does not name this host",
    ),
    (
        re.compile(r"pg_hba\.conf .*no encryption"),
        "the server requires TLS (sslmode=verify-full with sslrootcert in PIN_PG_DSN)",
    ),
    (
        re.compile(r"server does not support SSL"),
        "the server does not offer TLS, which PIN_PG_DSN's sslmode requires",
    ),
)


def connect_failure(dsn: str, exc: psycopg.OperationalError) -> PinError:
    """A failed connect as one line: the cause in an operator's words where libpq's is one of
    REFUSALS, then libpq's own first line (never a password: the URL is redacted)."""
    line = redact_url(first_line(exc))
    for pattern, words in REFUSALS:
        found = pattern.search(line)
        if found:
            return PinError(
                f"PostgreSQL at {redact_url(dsn)}: {words.format(**found.groupdict())} ({line})"
            )
    return PinError(f"PostgreSQL at {redact_url(dsn)} is unreachable: {line}")


#: What a statement of this release meets on a database it has not migrated.
UNMIGRATED = (
    pg_errors.InvalidSchemaName,
    pg_errors.UndefinedTable,
    pg_errors.UndefinedColumn,
    pg_errors.UndefinedFunction,
)


def unmigrated(dsn: str, exc: psycopg.Error) -> PinError:
    """One of UNMIGRATED as what to do about it."""
    return PinError(
        f"PostgreSQL at {redact_url(dsn)}: the schema is missing or older than this release "
        f"({first_line(exc)}); run `pin db migrate`"
    )


@contextmanager
def connection(
    dsn: str, *, autocommit: bool = False, session: Mapping[str, str] | None = None
) -> Iterator[psycopg.Connection]:
    """A connection closed at the end; losing it midway (the server went away, or went silent
    past the dead-peer bound) is a PinError naming the server, and so is a schema this release's
    statements do not find (a database never migrated, or migrated by an older release).
    `session` as for `connect`."""
    conn = connect(dsn, autocommit=autocommit, session=session)
    try:
        yield conn
    except UNMIGRATED as exc:
        raise unmigrated(dsn, exc) from exc
    except psycopg.OperationalError as exc:
        if not conn.broken:
            raise
        raise PinError(
            f"PostgreSQL at {redact_url(dsn)}: connection lost ({first_line(exc)}); what it had "
            "not committed was rolled back"
        ) from exc
    finally:
        conn.close()


def queries(name: str, face: Callable[..., Face]) -> Face:
    """Named queries of `sql/postgres/queries/<name>.sql` (aiosql, psycopg driver) seen through
    `face`, the file's Protocol in pin_pipelines/sql_faces.py (a Callable, not a `type[Face]`:
    mypy takes no Protocol class for the latter). The one place the untyped aiosql object is
    cast: tests/unit/test_named_queries.py holds each face to its file."""
    return cast(Face, _loaded(name))


@cache
def _loaded(name: str) -> Any:
    return aiosql.from_path(QUERIES_DIR / f"{name}.sql", "psycopg")


def sql_of(query: NamedQuery[Params]) -> str:
    """The SQL text of named query `query` (an attribute aiosql gives each one; faces declare
    only the call)."""
    text: str = query.sql  # type: ignore[attr-defined]
    return text


def fetch_one(
    query: NamedQuery[Params],
    conn: psycopg.Connection,
    row: type[Row],
    *_: Params.args,
    **params: Params.kwargs,
) -> Row | None:
    """The first row of named query `query` as a `row` (psycopg `class_row`: its fields are the
    query's column names, so a reordered SELECT cannot shift values into the wrong field).
    Parameters are keywords (the faces declare no positional one)."""
    with conn.cursor(row_factory=class_row(row)) as cursor:
        return cursor.execute(sql_of(query), params).fetchone()


def fetch_all(
    query: NamedQuery[Params],
    conn: psycopg.Connection,
    row: type[Row],
    *_: Params.args,
    **params: Params.kwargs,
) -> list[Row]:
    """Every row of named query `query`, each a `row` (see `fetch_one`)."""
    with conn.cursor(row_factory=class_row(row)) as cursor:
        return cursor.execute(sql_of(query), params).fetchall()


def fetch_column(
    query: NamedQuery[Params], conn: psycopg.Connection, *_: Params.args, **params: Params.kwargs
) -> list[Any]:
    """The one column of every row of named query `query`."""
    with conn.cursor(row_factory=scalar_row) as cursor:
        return cursor.execute(sql_of(query), params).fetchall()
