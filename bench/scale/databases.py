"""The run's databases: the named queries of bench/sql/bench_scale.sql, the databases' names, their
creation and drop, and the CPU meter of the processes that work in them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import psycopg
from _common import BASE_DSN, bench_queries, fresh_database
from _cpu import CpuMeter, postmaster_pid

from pin_pipelines.config import dsn_with_dbname

Q: Any = bench_queries("bench_scale")


def database_name(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


def storage_database(dsn: str) -> str:
    """The Dagster storage database of `pin serve` on `dsn`."""
    return f"{database_name(dsn)}_dagster"


def drop_database(name: str) -> None:
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_databases(
    stack: ExitStack, names: dict[str, str], labels: Iterable[str]
) -> dict[str, str]:
    """A fresh, migrated database per label (in the order of `labels`), each dropped when `stack`
    closes; returns their DSNs."""
    dsns: dict[str, str] = {}
    for label in labels:
        stack.callback(drop_database, names[label])
        dsns[label] = fresh_database(names[label])
    return dsns


def cpu_meter(dsns: dict[str, str], names: dict[str, str]) -> Callable[[], CpuMeter]:
    """A new CpuMeter per call: this run's processes, the backends of the catalogues' databases
    (postgres) and of their `pin serve` storage databases (dagster_postgres)."""
    with psycopg.connect(dsns["large"]) as conn:
        server = postmaster_pid(conn.info.backend_pid)
    kinds = {names[label]: "postgres" for label in dsns}
    kinds.update({storage_database(dsn): "dagster_postgres" for dsn in dsns.values()})
    return lambda: CpuMeter(kinds, server)
