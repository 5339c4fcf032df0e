"""The typed face of each file of `sql/postgres/queries/`: one Protocol per file, listing exactly
its named queries with their `:params` (keyword-only, as the modules pass them) and what aiosql
returns for each (`!` a row count, `$` one value, `^` one row or None, none a row iterator).

A module reaches a file as `Q = queries("<file>", <Face>)` (pin_pipelines/db.py), so mypy checks
every call of a named query, and of `fetch_one`/`fetch_all`/`fetch_column` on one, against its
face; tests/unit/test_named_queries.py checks each face against its file. A query whose rows a
module reads goes through those fetchers (its rows as small frozen dataclasses read by column
name): its face's return type is what calling it directly would give, there for completeness.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

from psycopg import Connection

#: What aiosql's psycopg adapter yields for a query without a suffix: the cursor's rows.
Rows = Iterator[tuple[Any, ...]]


class DevstatsQueries(Protocol):
    """sql/postgres/queries/devstats.sql: the dimension loader's counters."""

    def record_loader_batch(
        self, conn: Connection, *, inserted: int, skipped_stale: int
    ) -> int: ...


class MetricsQueries(Protocol):
    """sql/postgres/queries/metrics.sql: what the exporter reads."""

    def queue_gauges(self, conn: Connection) -> tuple[Any, ...] | None: ...

    def counter_totals(self, conn: Connection) -> Rows: ...

    def duration_buckets(self, conn: Connection) -> Rows: ...

    def worker_ticks(self, conn: Connection) -> tuple[Any, ...] | None: ...

    def scheduler_beats(self, conn: Connection) -> tuple[Any, ...] | None: ...


class OutboxQueries(Protocol):
    """sql/postgres/queries/outbox.sql: the outbox relay and its metrics."""

    def configure_session(
        self, conn: Connection, *, lock_timeout: str, idle_timeout: str
    ) -> tuple[Any, ...] | None: ...

    def listen_outbox(self, conn: Connection) -> int: ...

    def outbox_horizon(self, conn: Connection) -> int | None: ...

    def lock_relay(self, conn: Connection) -> int: ...

    def unlock_relay(self, conn: Connection) -> int: ...

    def relay_commit_state(
        self, conn: Connection, *, transactional_id: str
    ) -> tuple[Any, ...] | None: ...

    def record_commit(self, conn: Connection, *, transactional_id: str, seq: int) -> int | None: ...

    def claim_events(self, conn: Connection, *, horizon: int, limit: int) -> Rows: ...

    def dead_letter_events(self, conn: Connection, *, ids: list[int], errors: list[str]) -> int: ...

    def delete_published(self, conn: Connection, *, firsts: str, lasts: str) -> int: ...

    def count_runs(self, conn: Connection, *, firsts: str, lasts: str, uptos: str) -> Rows: ...

    def delete_recovered(self, conn: Connection, *, firsts: str, lasts: str, uptos: str) -> int: ...

    def record_events_beyond_source(
        self, conn: Connection, *, transactional_id: str, events: int
    ) -> int: ...

    def count_relayed(
        self,
        conn: Connection,
        *,
        topics: list[str],
        published: list[int],
        dead_lettered: list[int],
    ) -> int: ...

    def topic_stats(self, conn: Connection) -> Rows: ...

    def backlog(self, conn: Connection) -> tuple[Any, ...] | None: ...

    def events_beyond_source(self, conn: Connection) -> int: ...

    def relay_topics(self, conn: Connection) -> Rows: ...


class RecalcQueries(Protocol):
    """sql/postgres/queries/recalc.sql: the drain, its scheduler and the operators' requeue."""

    def count_due_requests(self, conn: Connection) -> int: ...

    def tick_settings(self, conn: Connection) -> tuple[Any, ...] | None: ...

    def settle_abandoned_claims(self, conn: Connection) -> Rows: ...

    def recalc_tick(
        self,
        conn: Connection,
        *,
        batch: int,
        claim_for: timedelta,
        attempted: list[UUID],
        traceparents: list[str] | None,
        lock_share: float,
    ) -> list[dict[str, Any]] | None:
        """One JSON object per project of the call (read by drain._ProjectReport.from_json)."""

    def poisoned_requests(self, conn: Connection) -> Rows: ...

    def beat_and_next_due_in_seconds(self, conn: Connection, *, scheduler: str) -> float | None: ...

    def next_due_in_seconds(self, conn: Connection) -> float | None: ...

    def project_exists(self, conn: Connection, *, project_id: UUID) -> bool | None: ...

    def force_request(self, conn: Connection, *, project_id: UUID, reason: str) -> int: ...

    def requeue_request(self, conn: Connection, *, project_id: UUID) -> int: ...

    def count_poisoned(self, conn: Connection) -> int: ...

    def fold_recalc_outcomes(self, conn: Connection) -> int: ...

    def record_tick(self, conn: Connection) -> int: ...


class ReconcileQueries(Protocol):
    """sql/postgres/queries/reconcile.sql: drift checks and their repairs."""

    def aggregate_drift_cells(self, conn: Connection) -> Rows: ...

    def aggregate_checked_counts(self, conn: Connection) -> tuple[Any, ...] | None: ...

    def queue_state(self, conn: Connection, *, project_ids: list[UUID]) -> Rows: ...

    def layout_group_sources(self, conn: Connection) -> Rows: ...

    def layout_groups_changed_before(
        self, conn: Connection, *, group_ids: list[UUID], seconds: float
    ) -> Rows: ...

    def lock_project_for_republish(self, conn: Connection, *, project_id: UUID) -> UUID | None: ...

    def align_layout_group_tenants(self, conn: Connection, *, group_ids: list[UUID]) -> int: ...

    def republish_layout_groups(
        self, conn: Connection, *, group_ids: list[UUID], floor_versions: list[int]
    ) -> int: ...

    def clear_events_beyond_source(self, conn: Connection, *, before: datetime) -> int: ...

    def clock(self, conn: Connection) -> datetime: ...


class SampleQueries(Protocol):
    """sql/postgres/queries/sample.sql: `pin sample load`."""

    def insert_sample_projects(self, conn: Connection, *, projects: int) -> Rows: ...
