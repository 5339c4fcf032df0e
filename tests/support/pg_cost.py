"""What a piece of code costs a database, from the server's own counters (`pg_stat_database`):
the transactions it ended and the sessions it opened. Every autocommit statement is a
transaction, so on a database nothing else uses this counts the statements that reached it.

A backend reports its counts when it ends (and now and then while it lives), so the counters are
read once the database has no session left and they stand still: the code measured must close
what it opens, and the test must hold no connection to the database meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql

from pin_pipelines.config import dsn_with_dbname
from tests.support.pg import dbname

#: How long the database may take to have no session and steady counters.
SETTLE_SECONDS = 20.0
#: Two reads this far apart that agree: the last backend's report is in.
STEADY_SECONDS = 0.3


@dataclass
class DatabaseCost:
    transactions: int = 0
    sessions: int = 0


def _counters(admin: psycopg.Connection, name: str) -> tuple[int, int, int]:
    """(transactions ended, sessions opened, sessions open now) of database `name`."""
    row = admin.execute(
        "SELECT d.xact_commit + d.xact_rollback, d.sessions,"
        "       (SELECT count(*) FROM pg_stat_activity a WHERE a.datname = d.datname)"
        " FROM pg_stat_database d WHERE d.datname = %s",
        (name,),
    ).fetchone()
    assert row is not None, f"no database {name}"
    return int(row[0]), int(row[1]), int(row[2])


def _settled(admin: psycopg.Connection, name: str) -> tuple[int, int]:
    """The counters once no session is open on `name` and they stand still (bounded)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    previous = None
    while True:
        transactions, sessions, open_now = _counters(admin, name)
        if open_now == 0 and previous == (transactions, sessions):
            return transactions, sessions
        assert time.monotonic() < deadline, (
            f"database {name} still has {open_now} session(s) or moving counters after "
            f"{SETTLE_SECONDS:g}s: something else uses it"
        )
        previous = (transactions, sessions) if open_now == 0 else None
        time.sleep(STEADY_SECONDS)


@contextmanager
def database_cost(dsn: str) -> Iterator[DatabaseCost]:
    """The transactions and sessions of `dsn`'s database while the block runs (filled in when it
    ends). The counters are read from the server's `postgres` database, with autovacuum off on
    the database's tables meanwhile: its workers' transactions count there too, and a test
    database that every test empties keeps them busy (10 drain sensor ticks once read 60
    transactions in CI, 20 of them the ticks')."""
    name = dbname(dsn)
    cost = DatabaseCost()
    with (
        _autovacuum_off(dsn),
        psycopg.connect(dsn_with_dbname(dsn, "postgres"), autocommit=True) as admin,
    ):
        transactions, sessions = _settled(admin, name)
        yield cost
        after_transactions, after_sessions = _settled(admin, name)
    cost.transactions = after_transactions - transactions
    cost.sessions = after_sessions - sessions


@contextmanager
def _autovacuum_off(dsn: str) -> Iterator[None]:
    """Autovacuum off on every table of `dsn`'s database while the block runs (a worker at work
    is cancelled by the ALTER's lock), back on after."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [
            sql.Identifier(schema, table)
            for schema, table in conn.execute(
                "SELECT schemaname, tablename FROM pg_tables"
                " WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
            ).fetchall()
        ]
        for table in tables:
            conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(table))
    try:
        yield
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for table in tables:
                conn.execute(sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(table))
