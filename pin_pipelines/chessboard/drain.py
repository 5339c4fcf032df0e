"""The drain of spec 000: one tick takes up to `batch_size` due rows, each project in its own
transaction, and recomputes its aggregates from the source tables with set-based SQL.

All SQL is in `sql/postgres/queries/recalc.sql`; this module only sequences it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

import psycopg
from psycopg import errors as pg_errors

from pin_pipelines.db import connection, queries
from pin_pipelines.logs import log_event
from pin_pipelines.metrics.recording import record_outcome, record_tick

log = logging.getLogger("pin_pipelines.recalc")

Outcome = Literal["recalculated", "skipped_archived", "failed", "deferred"]

#: One project is a handful of indexed aggregates (spec: p99 < 2 s); a statement running far
#: longer is stuck, and must not hold the tick (spec: tick < 30 s).
STATEMENT_TIMEOUT = "10s"
#: A row lock held by an HTTP edit of the same aggregate row is waited for this share of the
#: server's deadlock_timeout (1 s by default), then the project is deferred to the next tick (no
#: attempt counted): contention is not a poison. Below deadlock_timeout on purpose: when an API
#: transaction holds a row the drain needs and then waits for the queue row the drain holds (its
#: raiser), the drain gives up first, so PostgreSQL's deadlock detector never aborts the API's
#: edit (spec: sales, statuses and prices are never blocked by the recalc).
LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT = 0.5


@dataclass(frozen=True)
class ProjectResult:
    project_id: UUID
    outcome: Outcome
    duration_seconds: float
    republished: dict[str, int] = field(default_factory=dict)
    buildings_updated: int = 0
    requested_count: int = 0
    error: str | None = None


@dataclass
class TickSummary:
    correlation_id: str
    due_at_start: int = 0
    results: list[ProjectResult] = field(default_factory=list)
    poisoned: int = 0
    stopped_early: bool = False

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome == outcome)

    @property
    def processed(self) -> int:
        return self.count("recalculated")

    def as_dict(self) -> dict[str, Any]:
        republished: dict[str, int] = {"project": 0, "layout": 0, "layout_group": 0}
        for r in self.results:
            for entity, n in r.republished.items():
                republished[entity] += n
        durations = sorted(r.duration_seconds for r in self.results if r.outcome == "recalculated")
        return {
            "correlation_id": self.correlation_id,
            "due_at_start": self.due_at_start,
            "processed": self.processed,
            "failed": self.count("failed"),
            "skipped_archived": self.count("skipped_archived"),
            "deferred": self.count("deferred"),
            "poisoned": self.poisoned,
            "republished": republished,
            "coalesced_events": sum(
                r.requested_count for r in self.results if r.outcome != "failed"
            ),
            "duration_p50_seconds": _quantile(durations, 0.50),
            "duration_p99_seconds": _quantile(durations, 0.99),
            "stopped_early": self.stopped_early,
        }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 6)


def _never() -> bool:
    return False


def drain_tick(
    dsn: str,
    *,
    batch_size: int | None = None,
    should_stop: Callable[[], bool] = _never,
    correlation_id: str | None = None,
) -> TickSummary:
    """One worker tick. `should_stop` is checked between projects (graceful cancellation: the
    project in hand commits or rolls back whole, the rest stays queued). `correlation_id` tags
    every log line of the tick (a Dagster run passes its run id and tick number)."""
    q = queries("recalc")
    started = time.perf_counter()
    summary = TickSummary(correlation_id=correlation_id or uuid.uuid4().hex)
    with connection(dsn) as conn:
        conn.autocommit = True  # each project opens its own transaction below
        if batch_size is None:
            row = conn.execute("SELECT batch_size FROM chessboard.recalc_settings").fetchone()
            batch_size = int(row[0]) if row else 50
        summary.due_at_start = int(q.count_due_requests(conn))
        log_event(
            log,
            "recalc_batch_started",
            correlation_id=summary.correlation_id,
            size=min(summary.due_at_start, batch_size),
            due=summary.due_at_start,
        )
        for _ in range(batch_size):
            if should_stop():
                summary.stopped_early = True
                break
            attempted = [r.project_id for r in summary.results]
            result = _process_next(conn, summary.correlation_id, attempted)
            if result is None:
                break
            summary.results.append(result)
        summary.poisoned = int(q.count_poisoned(conn))
        record_tick(conn)  # worker liveness, also for a tick with nothing due
    totals = summary.as_dict()
    log_event(
        log,
        "recalc_batch_finished",
        **{
            k: totals[k]
            for k in (
                "correlation_id",
                "processed",
                "failed",
                "skipped_archived",
                "deferred",
                "poisoned",
                "republished",
                "stopped_early",
            )
        },
        duration_seconds=round(time.perf_counter() - started, 6),
    )
    if summary.poisoned:
        log_event(
            log,
            "CHESSBOARD_RECALC_POISON",
            level=logging.ERROR,
            correlation_id=summary.correlation_id,
            poisoned=summary.poisoned,
        )
    return summary


def _process_next(
    conn: psycopg.Connection, correlation_id: str, attempted: list[UUID]
) -> ProjectResult | None:
    q = queries("recalc")
    with conn.transaction():
        q.limit_waits(
            conn,
            statement_timeout=STATEMENT_TIMEOUT,
            lock_share=LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT,
        )
        # A row already tried in this tick (failed, or deferred on a lock) waits for the next one.
        claim = q.claim_due_request(conn, attempted=attempted)
        if claim is None:
            return None
        project_id, tenant_id, last_reason, requested_count, attempt_count, waited = claim
        context = {
            "correlation_id": correlation_id,
            "project_id": str(project_id),
            "tenant_id": str(tenant_id),
            "last_reason": last_reason,
        }
        started = time.perf_counter()
        try:
            # A savepoint: a failure rolls back the project's work but keeps the row locked, so
            # recording the failed attempt cannot race another drain that would claim the row.
            with conn.transaction():
                result = _recalc_project(conn, project_id, started, requested_count)
        except pg_errors.LockNotAvailable:
            result = ProjectResult(project_id, "deferred", time.perf_counter() - started)
            log_event(log, "project_recalc_deferred", **context, reason="row lock held elsewhere")
            record_outcome(conn, result)
            return result
        except Exception as exc:
            if conn.closed or conn.broken:
                raise
            error = f"{type(exc).__name__}: {exc}".strip()
            q.record_failure(conn, project_id=project_id, error=error)
            result = ProjectResult(
                project_id, "failed", time.perf_counter() - started, error=error[:1024]
            )
            record_outcome(conn, result)  # counters commit with the failed attempt
            log_event(
                log,
                "project_recalc_failed",
                level=logging.WARNING,
                **context,
                attempt_count=attempt_count + 1,
                error=error[:1024],
            )
            return result
        record_outcome(conn, result)  # counters commit with the recalc (or the archived skip)
    if result.outcome == "skipped_archived":
        log_event(log, "project_skipped_archived", **context)
    else:
        log_event(
            log,
            "project_recalculated",
            **context,
            duration_seconds=round(result.duration_seconds, 6),
            republished=result.republished,
            buildings_updated=result.buildings_updated,
            requested_count=requested_count,
            waited_seconds=round(waited, 3),
        )
    return result


def _recalc_project(
    conn: psycopg.Connection, project_id: UUID, started: float, requested_count: int
) -> ProjectResult:
    q = queries("recalc")
    project = q.lock_project(conn, project_id=project_id)
    if project is None or project[0] == "Archived" or project[1] is not None:
        # An archived or deleted project carries no aggregates: close the window, touch nothing.
        q.delete_request(conn, project_id=project_id)
        return ProjectResult(
            project_id,
            "skipped_archived",
            time.perf_counter() - started,
            requested_count=requested_count,
        )
    buildings = q.recalc_buildings(conn, project_id=project_id)
    republished = {
        "layout": q.recalc_layouts(conn, project_id=project_id),
        "layout_group": q.recalc_layout_groups(conn, project_id=project_id),
        "project": q.recalc_project(conn, project_id=project_id),
    }
    q.delete_request(conn, project_id=project_id)
    return ProjectResult(
        project_id,
        "recalculated",
        time.perf_counter() - started,
        republished=republished,
        buildings_updated=buildings,
        requested_count=requested_count,
    )


@dataclass
class DrainRunSummary:
    """Several ticks of one worker session (a Dagster run, or a long-running worker)."""

    ticks: list[TickSummary] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        merged = TickSummary(correlation_id=",".join(t.correlation_id for t in self.ticks[-1:]))
        for tick in self.ticks:
            merged.results.extend(tick.results)
        merged.due_at_start = self.ticks[0].due_at_start if self.ticks else 0
        merged.poisoned = self.ticks[-1].poisoned if self.ticks else 0
        merged.stopped_early = any(t.stopped_early for t in self.ticks)
        return {**merged.as_dict(), "ticks": len(self.ticks)}

    @property
    def poisoned(self) -> int:
        return self.ticks[-1].poisoned if self.ticks else 0


def seconds_until_next_due(dsn: str) -> float | None:
    """<= 0: a row is due now; None: nothing (non-poisoned) is queued."""
    with connection(dsn) as conn:
        value = queries("recalc").next_due_in_seconds(conn)
    return None if value is None else float(value)


def drain_until_idle(
    dsn: str,
    *,
    budget_seconds: float = 25.0,
    wait_for_due_within: float = 15.0,
    should_stop: Callable[[], bool] = _never,
    sleep: Callable[[float], None] = time.sleep,
    correlation_prefix: str | None = None,
) -> DrainRunSummary:
    """Tick until nothing is due, or the budget is spent: one run launch serves many ticks.

    A row that falls due within `wait_for_due_within` seconds is waited for rather than left to
    the next launch, which costs seconds of scheduling lag on a busy daemon. Tick n logs with
    correlation id `<correlation_prefix>.<n>` when a prefix (the Dagster run id) is given.
    """
    deadline = time.monotonic() + budget_seconds
    run = DrainRunSummary()

    def stop() -> bool:
        return should_stop() or time.monotonic() >= deadline

    while not stop():
        tick_id = f"{correlation_prefix}.{len(run.ticks) + 1}" if correlation_prefix else None
        tick = drain_tick(dsn, should_stop=stop, correlation_id=tick_id)
        run.ticks.append(tick)
        if tick.results:
            continue  # a full or partial batch: more may be due already
        next_due = seconds_until_next_due(dsn)
        remaining = deadline - time.monotonic()
        if next_due is None or next_due > min(wait_for_due_within, remaining):
            break
        sleep(max(0.05, min(next_due, 1.0)))
    return run
