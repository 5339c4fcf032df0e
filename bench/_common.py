"""Shared set-up for benchmarks: a dedicated, migrated database and fast synthetic projects."""

from __future__ import annotations

import os
import statistics
from typing import Any

import psycopg

from pin_pipelines.config import dsn_with_dbname
from pin_pipelines.migrate import migrate_postgres

BASE_DSN = os.environ.get("PIN_PG_DSN", "postgresql://postgres@127.0.0.1:5432/pin")


def fresh_database(name: str) -> str:
    """Drop and recreate `name` on the PIN_PG_DSN server, migrated; returns its DSN."""
    with psycopg.connect(dsn_with_dbname(BASE_DSN, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = dsn_with_dbname(BASE_DSN, name)
    migrate_postgres(dsn)
    return dsn


def quantiles(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(ordered),
        "p50_ms": round(pick(0.50) * 1000, 3),
        "p99_ms": round(pick(0.99) * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }
