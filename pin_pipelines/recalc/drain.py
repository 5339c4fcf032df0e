"""The drain of spec 000: one tick takes up to `batch_size` due rows, each project in its own
transaction, and recomputes its aggregates from the source tables with set-based SQL.

All SQL is in `sql/postgres/queries/recalc.sql`; this module only sequences it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal, TypedDict, Unpack
from uuid import UUID

import psycopg
from psycopg import errors as pg_errors

from pin_pipelines.db import connection, fetch_all, fetch_one, queries
from pin_pipelines.logs import log_event
from pin_pipelines.quantiles import quantile
from pin_pipelines.recalc.counters import ENTITIES, record_tick
from pin_pipelines.sql_faces import RecalcQueries
from pin_pipelines.tracing import child_traceparents, record_child_span, tracer
from pin_pipelines.worker import Budget, never, run_until_spent

log = logging.getLogger("pin_pipelines.recalc")

Q = queries("recalc", RecalcQueries)

Outcome = Literal["recalculated", "skipped_archived", "failed", "deferred", "interrupted"]

#: One project is a handful of indexed aggregates (spec: p99 < 2 s); a project whose work runs
#: far longer is stuck, and must not hold the tick (spec: tick < 30 s): it fails, its run counted.
PROJECT_TIMEOUT_SECONDS = 10.0
#: How long a recalc_tick call (schema/recalc.sql: a tick's projects in one CALL, a COMMIT each)
#: goes on claiming projects: the drain obeys a stop, and its tick budget, between calls, so this is
#: how much later than between two projects (spec 000: cancellation between projects). A tick
#: of 50 small projects still takes one call: ~40 ms unchanged, ~70 ms rewritten (bench_recalc).
CLAIM_WINDOW_SECONDS = 0.1
#: The longest a recalc_tick call runs: its statement timeout covers the whole call (a COMMIT
#: inside a procedure does not re-arm it), whose last project starts within the claiming window,
#: so every project gets its full bound. Read when a drain connection opens (drain_connection).
CALL_TIMEOUT_SECONDS = PROJECT_TIMEOUT_SECONDS + CLAIM_WINDOW_SECONDS
#: Spec 000: a tick takes LESS than 30 s.
TICK_LIMIT_SECONDS = 30.0
#: What a tick spends besides its calls, kept free below the limit: its own statements before
#: and after them (the settle, the counts, its liveness record: milliseconds each), its log
#: lines, and a statement timeout's landing (the server checks for it between steps).
TICK_MARGIN_SECONDS = 2.0
#: A stop's cancel comes at the latest this long before a call's statement timeout would fire,
#: room for the cancel request to arrive, so a stop is never counted as the project's failed run.
CANCEL_BEFORE_TIMEOUT_SECONDS = 1.0
#: How soon the server sees that the drain died (killed, OOM) during a call and ends it, the
#: project in hand rolled back instead of run on to its COMMIT; its claim (committed with the
#: previous project) is left to settle_abandoned_claims, so a project that kills its drain ends
#: as poison. Projects a dead drain's call commits within this interval are complete.
CLIENT_CHECK_INTERVAL = "100ms"
#: The drain session's settings, in force from its first statement (db.connect's `session`). A
#: drain that stops sending inside a transaction (stopped, or its host cut off) loses its session
#: after the project timeout, and with it the project's row locks: another drain takes the
#: project over. Row lock waits are bounded by the SQL itself: the work's by recalc_claimed_project
#: (lock_timeout), those of recalc_tick's handlers by end_claim (schema/recalc.sql).
DRAIN_SESSION = {
    "idle_in_transaction_session_timeout": f"{round(PROJECT_TIMEOUT_SECONDS * 1000)}ms",
    "client_connection_check_interval": CLIENT_CHECK_INTERVAL,
    "plan_cache_mode": "force_generic_plan",
}
#: A row lock held by an HTTP edit of the same aggregate row is waited for this share of the
#: server's deadlock_timeout (1 s by default), then the project is deferred to the next tick (no
#: attempt counted): contention is not a poison. Below deadlock_timeout on purpose: when an API
#: transaction holds a row the drain needs and then waits for the queue row the drain holds (its
#: raiser), the drain gives up first, so PostgreSQL's deadlock detector never aborts the API's
#: edit (spec: sales, statuses and prices are never blocked by the recalc).
LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT = 0.5
#: After a stop (SIGTERM, a run's budget spent), the call in hand gets this long to finish
#: before it is cancelled: its project in hand then rolls back whole and its attempt is given
#: back, so a deploy never waits out a stuck project nor counts it towards poison.
STOP_GRACE_SECONDS = 5.0
#: Projects per tick without a `chessboard.recalc_settings` row.
DEFAULT_BATCH_SIZE = 50


@dataclass(frozen=True)
class ProjectResult:
    project_id: UUID
    outcome: Outcome
    duration_seconds: float
    republished: dict[str, int] = field(default_factory=dict)
    buildings_updated: int = 0
    #: A done project's requests served: its queue row's requested_count when the work locked
    #: it (one that landed after the claim included).
    requested_count: int = 0
    error: str | None = None
    #: A failed project's failed runs, this one included.
    attempt_count: int | None = None


@dataclass
class TickSummary:
    correlation_id: str
    due_at_start: int = 0
    results: list[ProjectResult] = field(default_factory=list)
    poisoned: int = 0
    #: Rows this tick made poison (a failed run, or an abandoned attempt settled, reaching
    #: poison_attempts): each logged once, at ERROR, as CHESSBOARD_RECALC_POISON.
    newly_poisoned: list[UUID] = field(default_factory=list)
    stopped_early: bool = False

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome == outcome)

    @property
    def processed(self) -> int:
        return self.count("recalculated")

    def merge(self, later: TickSummary) -> None:
        """Fold a later tick in: a run's totals in a tick's shape (one shape for the CLI's JSON
        and a Dagster run's summary). Results add up; the correlation id and the queue's state
        (poisoned) are the later tick's, `due_at_start` stays this one's."""
        self.correlation_id = later.correlation_id
        self.results.extend(later.results)
        self.poisoned = later.poisoned
        self.newly_poisoned.extend(later.newly_poisoned)
        self.stopped_early = self.stopped_early or later.stopped_early

    def as_dict(self) -> dict[str, Any]:
        republished = dict.fromkeys(ENTITIES, 0)
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
            "interrupted": self.count("interrupted"),
            "poisoned": self.poisoned,
            "republished": republished,
            "coalesced_events": sum(r.requested_count for r in self.results),
            "duration_p50_seconds": quantile(durations, 0.50),
            "duration_p99_seconds": quantile(durations, 0.99),
            "stopped_early": self.stopped_early,
            # Bounded by the batch size: the run's event log carries failures with their error.
            "failures": {str(r.project_id): r.error for r in self.results if r.outcome == "failed"},
        }


def drain_connection(dsn: str) -> AbstractContextManager[psycopg.Connection]:
    """A connection in the drain's session (DRAIN_SESSION, and CALL_TIMEOUT_SECONDS as its
    statement timeout), autocommit: a procedure may COMMIT (recalc_tick, a transaction per
    project) only when called outside a transaction block."""
    timeout = f"{round(CALL_TIMEOUT_SECONDS * 1000)}ms"
    return connection(dsn, autocommit=True, session={**DRAIN_SESSION, "statement_timeout": timeout})


def tick_budget_seconds(
    limit_seconds: float = TICK_LIMIT_SECONDS, margin_seconds: float = TICK_MARGIN_SECONDS
) -> float:
    """How long a tick that must end within `limit_seconds` starts recalc_tick calls: the last
    call it starts ends by its statement timeout (CALL_TIMEOUT_SECONDS, read now), and the
    margin is left for the rest. 30 - 10.1 - 2 = 17.9 s by default: a tick of slow projects
    ends before 28 s, whatever they do. Nothing is cancelled at the budget's end: every project
    claimed gets its full bound, a stuck one failing on its timeout as in any tick."""
    return limit_seconds - CALL_TIMEOUT_SECONDS - margin_seconds


class TickOptions(TypedDict, total=False):
    """tick_on's keyword arguments, which drain_tick passes on."""

    batch_size: int | None
    should_stop: Callable[[], bool]
    correlation_id: str | None
    stop_grace_seconds: float
    limit_seconds: float
    margin_seconds: float


def drain_tick(dsn: str, **options: Unpack[TickOptions]) -> TickSummary:
    """One worker tick on a connection of its own (`pin recalc drain --once`); a drain run ticks
    on one connection throughout (drain_until_idle). See tick_on."""
    with drain_connection(dsn) as conn:
        return tick_on(conn, **options)


def tick_on(
    conn: psycopg.Connection,
    *,
    batch_size: int | None = None,
    should_stop: Callable[[], bool] = never,
    correlation_id: str | None = None,
    stop_grace_seconds: float = STOP_GRACE_SECONDS,
    limit_seconds: float = TICK_LIMIT_SECONDS,
    margin_seconds: float = TICK_MARGIN_SECONDS,
) -> TickSummary:
    """One worker tick on `conn` (a drain_connection). `should_stop` is checked between
    recalc_tick calls, each claiming for at most CLAIM_WINDOW_SECONDS (graceful cancellation: the
    projects of the call in hand commit or roll back whole, one by one, the rest stays queued); a
    call still running `stop_grace_seconds` after the stop is cancelled, its project in hand
    given back. The tick ends within `limit_seconds` less `margin_seconds` (spec 000: a tick
    takes < 30 s): it starts no call past tick_budget_seconds, and the call in hand ends by its
    statement timeout.
    `correlation_id` tags every log line of the tick (a Dagster run passes its run id and tick
    number)."""
    started = time.perf_counter()
    budget = Budget(tick_budget_seconds(limit_seconds, margin_seconds), should_stop)
    summary = TickSummary(correlation_id=correlation_id or uuid.uuid4().hex)
    with tracer().start_as_current_span(
        "recalc.tick", attributes={"correlationId": summary.correlation_id}
    ):
        settings = fetch_one(Q.tick_settings, conn, _TickSettings)
        if batch_size is None:
            batch_size = DEFAULT_BATCH_SIZE if settings is None else settings.batch_size
        poison_at = None if settings is None else settings.poison_attempts
        poisoning = _settle_abandoned_claims(conn, summary.correlation_id, poison_at)
        summary.due_at_start = int(Q.count_due_requests(conn))
        # A tick with nothing due logs at DEBUG: a run waiting for rows about to fall due ticks
        # every second, and those lines were most of its compute log.
        quiet = logging.DEBUG if summary.due_at_start == 0 else logging.INFO
        log_event(
            log,
            "recalc_batch_started",
            level=quiet,
            correlation_id=summary.correlation_id,
            size=min(summary.due_at_start, batch_size),
            due=summary.due_at_start,
        )
        with _cancelled_after_stop(conn, should_stop, stop_grace_seconds) as call:
            _run_batch(conn, summary, batch_size, budget, call)
        poisoning += [
            _Poisoning(r.project_id, r.attempt_count, r.error)
            for r in summary.results
            if r.outcome == "failed" and _poisons(r.attempt_count, poison_at)
        ]
        summary.newly_poisoned = [p.project_id for p in poisoning]
        summary.poisoned = int(Q.count_poisoned(conn))
        record_tick(conn)  # worker liveness, also for a tick with nothing due
    totals = summary.as_dict()
    log_event(
        log,
        "recalc_batch_finished",
        level=quiet if not summary.results else logging.INFO,
        **{
            k: totals[k]
            for k in (
                "correlation_id",
                "processed",
                "failed",
                "skipped_archived",
                "deferred",
                "interrupted",
                "poisoned",
                "republished",
                "stopped_early",
            )
        },
        duration_seconds=round(time.perf_counter() - started, 6),
    )
    # Once per row, when it becomes poison: the gauge and its alert say it is still there (a
    # line on every tick while a row waited for triage was the same news again and again).
    for poisoned in poisoning:
        log_event(
            log,
            "CHESSBOARD_RECALC_POISON",
            level=logging.ERROR,
            correlation_id=summary.correlation_id,
            project_id=str(poisoned.project_id),
            attempt_count=poisoned.attempt_count,
            error=poisoned.error,
            poisoned=summary.poisoned,
        )
    return summary


@dataclass(frozen=True)
class _TickSettings:
    """The queue settings a tick reads (tick_settings)."""

    batch_size: int
    poison_attempts: int


@dataclass(frozen=True)
class _Poisoning:
    """A row this tick made poison: its failed runs and the last one's error."""

    project_id: UUID
    attempt_count: int | None
    error: str | None


def _poisons(failed_runs: int | None, poison_at: int | None) -> bool:
    """Whether a row's failed runs, counted just now, make it poison. A claimed row had fewer
    than poison_attempts (poison rows are never claimed), so this is the run that crossed."""
    return failed_runs is not None and poison_at is not None and failed_runs >= poison_at


@dataclass(frozen=True)
class _AbandonedClaim:
    """A claim whose drain died inside the attempt, now counted (settle_abandoned_claims)."""

    project_id: UUID
    attempt_count: int
    last_error: str


def _settle_abandoned_claims(
    conn: psycopg.Connection, correlation_id: str, poison_at: int | None
) -> list[_Poisoning]:
    """Count the attempts of drains that died inside them as the failed runs they were; the
    rows this made poison are returned. The same statement first writes the ends of attempts a
    writer kept from their rows (chessboard.recalc_pending_claim_ends, schema/recalc.sql): those
    were reported by the tick that ended them, and are not abandoned."""
    poisoning = []
    for claim in fetch_all(Q.settle_abandoned_claims, conn, _AbandonedClaim):
        log_event(
            log,
            "project_claim_abandoned",
            level=logging.WARNING,
            correlation_id=correlation_id,
            project_id=str(claim.project_id),
            attempt_count=claim.attempt_count,
            error=claim.last_error,
        )
        if _poisons(claim.attempt_count, poison_at):
            poisoning.append(_Poisoning(claim.project_id, claim.attempt_count, claim.last_error))
    return poisoning


@dataclass(frozen=True)
class _ProjectReport:
    """One project of a recalc_tick call (schema/recalc.sql): its claim and what became of it."""

    project_id: UUID
    tenant_id: UUID
    last_reason: str
    #: Failed runs before this attempt.
    attempt_count: int
    waited_seconds: float
    outcome: Outcome
    #: When the project's work started, epoch seconds (the server's clock).
    started: float
    #: The work, from its start to its outcome recorded (the histogram's).
    duration_seconds: float
    buildings_written: int | None
    layouts_published: int | None
    layout_groups_published: int | None
    projects_published: int | None
    #: A failure as stored in last_error: psycopg's exception name for its SQLSTATE, then the
    #: error as libpq prints it, at most 1024 characters.
    error: str | None
    #: A failed project's failed runs, this one included.
    failed_runs: int | None
    #: A done project's requests served (its row's requested_count under the work's lock).
    requests_served: int | None

    @classmethod
    def from_json(cls, report: dict[str, Any]) -> _ProjectReport:
        return cls(
            project_id=UUID(report["project_id"]),
            tenant_id=UUID(report["tenant_id"]),
            last_reason=report["last_reason"],
            attempt_count=report["attempt_count"],
            waited_seconds=report["waited_seconds"],
            outcome=report["outcome"],
            started=report["started"],
            duration_seconds=report["duration_seconds"],
            buildings_written=report.get("buildings_written"),
            layouts_published=report.get("layouts_published"),
            layout_groups_published=report.get("layout_groups_published"),
            projects_published=report.get("projects_published"),
            error=report.get("error"),
            failed_runs=report.get("failed_runs"),
            requests_served=report.get("requests_served"),
        )

    def log_fields(self, correlation_id: str) -> dict[str, Any]:
        """The fields every per-project log line starts with, in this order."""
        return {
            "correlation_id": correlation_id,
            "project_id": str(self.project_id),
            "tenant_id": str(self.tenant_id),
            "last_reason": self.last_reason,
        }

    def span_attributes(self, correlation_id: str) -> dict[str, str | int]:
        """The project span's attributes, named as spec 000 names them (the log lines keep the
        snake_case of every other JSON field)."""
        return {
            "correlationId": correlation_id,
            "ProjectId": str(self.project_id),
            "TenantId": str(self.tenant_id),
            "LastReason": self.last_reason,
            "AttemptCount": self.attempt_count,
        }

    @property
    def republished(self) -> dict[str, int]:
        return {
            "layout": self.layouts_published or 0,
            "layout_group": self.layout_groups_published or 0,
            "project": self.projects_published or 0,
        }

    def result(self) -> ProjectResult:
        """The outcome's figures, each kind with only its own: republished rows for a
        recalculated project, requests served for one done (recalculated or archived), the
        error and failed runs for a failure."""
        recalculated = self.outcome == "recalculated"
        failed = self.outcome == "failed"
        return ProjectResult(
            self.project_id,
            self.outcome,
            self.duration_seconds,
            republished=self.republished if recalculated else {},
            buildings_updated=(self.buildings_written or 0) if recalculated else 0,
            requested_count=(self.requests_served or 0) if self.outcome in _DONE else 0,
            error=self.error if failed else None,
            attempt_count=self.failed_runs if failed else None,
        )

    def log_line(self, correlation_id: str) -> tuple[str, int, dict[str, Any]]:
        """The outcome's log line: its event, level and fields. A recalculated project: the
        spec's fields (duration, republished counts) and the wait; a line per project is most of
        a drain run's compute log, so nothing more."""
        event, level = _OUTCOME_EVENTS[self.outcome]
        fields = self.log_fields(correlation_id)
        if self.outcome == "recalculated":
            fields |= {
                "duration_seconds": round(self.duration_seconds, 4),
                "republished": self.republished,
                "waited_seconds": round(self.waited_seconds, 1),
            }
        elif self.outcome == "failed":
            fields |= {"attempt_count": self.failed_runs, "error": self.error}
        elif self.outcome == "deferred":
            fields |= {"reason": "row lock held elsewhere"}
        elif self.outcome == "interrupted":
            fields |= {"reason": "the drain is stopping"}
        return event, level, fields


#: Outcomes that leave the project's queue row in place for a later tick.
_STILL_QUEUED = frozenset({"failed", "deferred"})
#: Outcomes that end the project's queue row: its coalesced requests are served.
_DONE = frozenset({"recalculated", "skipped_archived"})

#: The log line of each outcome of a claimed project: its event and level.
_OUTCOME_EVENTS: dict[Outcome, tuple[str, int]] = {
    "recalculated": ("project_recalculated", logging.INFO),
    "skipped_archived": ("project_skipped_archived", logging.INFO),
    "failed": ("project_recalc_failed", logging.WARNING),
    "deferred": ("project_recalc_deferred", logging.INFO),
    "interrupted": ("project_recalc_interrupted", logging.INFO),
}


@contextmanager
def _cancelled_after_stop(
    conn: psycopg.Connection, should_stop: Callable[[], bool], grace: float
) -> Iterator[_CallInHand]:
    """Watches `should_stop` while the tick runs: once it holds, the recalc_tick call still
    running (the yielded _CallInHand) is cancelled after `grace` seconds, or sooner, just
    before the call's statement timeout would fire: the call gives the project in hand back and
    returns. A stop late in a stuck project used to be overtaken by the timeout during its
    grace (cancelled 5 s after a stop 6 s into the project, the timeout at 10 s): the project
    was counted a failed run, and a deploy could poison it. Nothing is cancelled between calls,
    where the stop is simply obeyed."""
    call = _CallInHand()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if should_stop():
                grace_ends = time.monotonic() + grace
                while not done.wait(0.05):
                    started, now = call.started, time.monotonic()
                    cancel_by = CALL_TIMEOUT_SECONDS - CANCEL_BEFORE_TIMEOUT_SECONDS
                    if started is not None and now >= min(grace_ends, started + cancel_by):
                        conn.cancel_safe()
                        return
                    if now >= grace_ends:
                        return
                return

    watcher = threading.Thread(target=watch, name="drain-stop-watch", daemon=True)
    watcher.start()
    try:
        yield call
    finally:
        done.set()
        watcher.join()


class _CallInHand:
    """The recalc_tick call in flight: since when (the client's clock, a little before the
    server's statement start), None between calls."""

    def __init__(self) -> None:
        self.started: float | None = None

    def begin(self) -> None:
        self.started = time.monotonic()

    def end(self) -> None:
        self.started = None


def _run_batch(
    conn: psycopg.Connection,
    summary: TickSummary,
    batch_size: int,
    budget: Budget,
    call: _CallInHand,
) -> None:
    """Up to `batch_size` projects in recalc_tick calls (schema/recalc.sql: a COMMIT per project),
    each claiming for at most CLAIM_WINDOW_SECONDS, so that a stop or the budget's end is
    obeyed between calls. Each project's span and log line are written from the call's
    report."""
    # A row already tried in this tick (failed, or deferred on a lock) waits for the next one;
    # only those rows are still queued (the others were deleted), so only they are excluded.
    attempted: list[UUID] = []
    left = batch_size
    while left > 0:
        if budget.stopping():
            summary.stopped_early = True
            return
        traceparents = child_traceparents(left)
        call.begin()
        try:
            reports = Q.recalc_tick(
                conn,
                batch=left,
                claim_for=timedelta(seconds=min(CLAIM_WINDOW_SECONDS, budget.remaining())),
                attempted=attempted,
                traceparents=traceparents,
                lock_share=LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT,
            )
        except pg_errors.QueryCanceled:
            # A cancel inside a project ends the call normally (recalc_tick: the project is
            # reported "interrupted", or "failed" for the statement timeout). One that landed
            # between two projects' blocks ends it with the error instead: the projects the call
            # committed are not reported, and a claim in hand is settled at the next tick.
            if not budget.should_stop():
                raise
            summary.stopped_early = True
            return
        finally:
            # Interrupted some other way (KeyboardInterrupt, a Dagster run terminated from the
            # UI): psycopg cancels the call before the interruption goes on, and the call gives
            # the project in hand back itself.
            call.end()
        if not reports:
            return
        for n, report in enumerate(map(_ProjectReport.from_json, reports)):
            _report(report, summary.correlation_id, traceparents[n] if traceparents else None)
            summary.results.append(report.result())
            if report.outcome in _STILL_QUEUED:
                attempted.append(report.project_id)
            if report.outcome == "interrupted":
                summary.stopped_early = True
                return
        left -= len(reports)


def _report(report: _ProjectReport, correlation_id: str, traceparent: str | None) -> None:
    """A project's span (its id the one the call stamped into the events) and log line."""
    started = int(report.started * 1e9)
    record_child_span(
        "recalc.project",
        traceparent,
        start_ns=started,
        end_ns=started + int(report.duration_seconds * 1e9),
        attributes=report.span_attributes(correlation_id),
    )
    event, level, fields = report.log_line(correlation_id)
    log_event(log, event, level=level, **fields)


@dataclass
class DrainRunSummary:
    """Several ticks of one worker session (a Dagster run, or a long-running worker); mergeable
    (pin_pipelines.worker), a tick's own run being a summary of one tick."""

    ticks: list[TickSummary] = field(default_factory=list)

    def merge(self, later: DrainRunSummary) -> None:
        """A later run's ticks follow this run's."""
        self.ticks.extend(later.ticks)

    @property
    def found_work(self) -> bool:
        """A tick took a project (a full or partial batch): more may be due already."""
        return any(t.results for t in self.ticks)

    def totals(self) -> TickSummary:
        """The ticks merged: the run's counts in a tick's shape."""
        if not self.ticks:
            return TickSummary(correlation_id="")
        first, *later = self.ticks
        total = replace(
            first, results=list(first.results), newly_poisoned=list(first.newly_poisoned)
        )
        for tick in later:
            total.merge(tick)
        return total

    def as_dict(self) -> dict[str, Any]:
        """A tick's as_dict for the run's totals, and how many ticks it took."""
        return {**self.totals().as_dict(), "ticks": len(self.ticks)}

    def metadata(self) -> dict[str, Any]:
        """as_dict as flat values (a Dagster run's asset event): republished per entity,
        without the correlation id and the failures that the run's summary line carries."""
        data = self.as_dict()
        republished = data.pop("republished")
        del data["correlation_id"], data["failures"]
        return {**data, **{f"republished_{entity}": n for entity, n in republished.items()}}

    @property
    def poisoned(self) -> int:
        return self.ticks[-1].poisoned if self.ticks else 0

    @property
    def newly_poisoned(self) -> list[UUID]:
        """The rows the run's ticks made poison, in order."""
        return [project for tick in self.ticks for project in tick.newly_poisoned]


def seconds_until_next_due(dsn: str, *, beat_as: str) -> float | None:
    """<= 0: a row is due now; None: nothing (non-poisoned) is queued.

    `beat_as` names the scheduler asking on its tick: its beat is recorded in the same statement,
    so liveness (CHESSBOARD_RECALC_WORKER_DOWN) costs no connection nor transaction of its own.
    """
    with connection(dsn, autocommit=True) as conn:
        value = Q.beat_and_next_due_in_seconds(conn, scheduler=beat_as)
    return None if value is None else float(value)


def _seconds_until_next_due(conn: psycopg.Connection) -> float | None:
    value = Q.next_due_in_seconds(conn)
    return None if value is None else float(value)


def drain_until_idle(
    dsn: str,
    *,
    budget_seconds: float = 25.0,
    wait_for_due_within: float = 15.0,
    should_stop: Callable[[], bool] = never,
    correlation_prefix: str | None = None,
) -> DrainRunSummary:
    """Tick until nothing is due, or the budget is spent: one run launch serves many ticks.

    The ticks share one connection: a new backend costs the server ~10 ms of CPU before its
    first project (its start, the catalog, the drain's plpgsql compiled and planned), as much
    as ten steady projects, and a run waiting for rows ticks every second. A connection lost
    between ticks ends the run like one lost inside a tick.

    A row that falls due within `wait_for_due_within` seconds is waited for rather than left to
    the next launch, which costs seconds of scheduling lag on a busy daemon (a stop ends that
    wait at once). Tick n logs with correlation id `<correlation_prefix>.<n>` when a prefix (the
    Dagster run id) is given.
    """
    budget = Budget(budget_seconds, should_stop)
    run = DrainRunSummary()
    with drain_connection(dsn) as conn:

        def tick() -> DrainRunSummary:
            tick_id = f"{correlation_prefix}.{len(run.ticks) + 1}" if correlation_prefix else None
            return DrainRunSummary(
                [tick_on(conn, should_stop=budget.stopping, correlation_id=tick_id)]
            )

        def wait_for_due() -> float | None:
            """After a tick that took nothing: up to a second towards the next row's due time,
            or None (the run ends) when none falls due within `wait_for_due_within` and the
            budget."""
            next_due = _seconds_until_next_due(conn)
            if next_due is None or next_due > min(wait_for_due_within, budget.remaining()):
                return None
            return max(0.05, min(next_due, 1.0))

        return run_until_spent(tick, budget, run, idle_seconds=wait_for_due)
