"""The dimension loader's counters, written where it counts (a named query of `devstats.sql`);
the exporter (`pin_pipelines.metrics`) only reads them."""

from __future__ import annotations

import psycopg

from pin_pipelines.db import queries
from pin_pipelines.sql_faces import DevstatsQueries

Q = queries("devstats", DevstatsQueries)


def record_loader_batch(conn: psycopg.Connection, *, inserted: int, skipped_stale: int) -> None:
    """The dimension loader's ClickHouse outcome of one batch (call after its offset commit)."""
    Q.record_loader_batch(conn, inserted=inserted, skipped_stale=skipped_stale)
