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
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any, Literal, TypedDict, Unpack
from uuid import UUID

import psycopg
from psycopg import errors as pg_errors

from pin_pipelines.db import connection, fetch_all, fetch_one, queries
from pin_pipelines.errors import first_line
from pin_pipelines.logs import log_event
from pin_pipelines.quantiles import quantile
from pin_pipelines.recalc.counters import ENTITIES, record_tick
from pin_pipelines.tracing import current_traceparent, tracer
from pin_pipelines.worker import Budget, never, run_until_spent

log = logging.getLogger("pin_pipelines.recalc")

Q: Any = queries("recalc")

Outcome = Literal["recalculated", "skipped_archived", "failed", "deferred", "interrupted"]

#: One project is a handful of indexed aggregates (spec: p99 < 2 s); a project whose work (one
#: statement, recalc_project_step) runs far longer is stuck, and must not hold the tick
#: (spec: tick < 30 s): it fails.
STATEMENT_TIMEOUT = "10s"
#: A project's work is one autocommit statement: how soon the server sees that its drain died
#: (killed, OOM) and rolls the work back instead of running it on to its COMMIT, which leaves the
#: attempt's claim to settle_abandoned_claims (a project that kills its drain ends as poison). A
#: drain that dies in the last interval of a statement may see its work committed: complete, and
#: the next claim, taken with it, is then counted as a failed run, as a claim abandoned before
#: its work started always was.
CLIENT_CHECK_INTERVAL = "100ms"
#: The drain session's settings, in force from its first statement (db.connect's `session`). A
#: drain that stops sending inside a transaction (stopped, or its host cut off) loses its session
#: after the statement timeout, and with it the project's row locks: another drain takes the
#: project over. Row lock waits are bounded by recalc_claimed_project itself (lock_timeout).
DRAIN_SESSION = {
    "statement_timeout": STATEMENT_TIMEOUT,
    "idle_in_transaction_session_timeout": STATEMENT_TIMEOUT,
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
#: After a stop (SIGTERM, a run's budget spent), the project in hand gets this long to finish
#: before its statement is cancelled: it then rolls back whole and its attempt is given back, so a
#: deploy never waits out a stuck project nor counts it towards poison.
STOP_GRACE_SECONDS = 5.0
#: Spec 000: a tick takes < 30 s. No project is claimed once less than the stop grace is left,
#: and the one in hand at the budget's end is cancelled then, as after a stop (rolled back whole,
#: its attempt given back): a tick of slow projects ends within its budget, however many are due.
TICK_BUDGET_SECONDS = 30.0
#: Projects per tick without a `chessboard.recalc_settings` row.
DEFAULT_BATCH_SIZE = 50


@dataclass(frozen=True)
class ProjectResult:
    project_id: UUID
    outcome: Outcome
    duration_seconds: float
    republished: dict[str, int] = field(default_factory=dict)
    buildings_updated: int = 0
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
            "coalesced_events": sum(
                r.requested_count for r in self.results if r.outcome != "failed"
            ),
            "duration_p50_seconds": quantile(durations, 0.50),
            "duration_p99_seconds": quantile(durations, 0.99),
            "stopped_early": self.stopped_early,
            # Bounded by the batch size: the run's event log carries failures with their error.
            "failures": {str(r.project_id): r.error for r in self.results if r.outcome == "failed"},
        }


def drain_connection(dsn: str) -> AbstractContextManager[psycopg.Connection]:
    """A connection in the drain's session (DRAIN_SESSION), autocommit: each project's work is
    one statement."""
    return connection(dsn, autocommit=True, session=DRAIN_SESSION)


class TickOptions(TypedDict, total=False):
    """tick_on's keyword arguments, which drain_tick passes on."""

    batch_size: int | None
    should_stop: Callable[[], bool]
    correlation_id: str | None
    stop_grace_seconds: float
    budget_seconds: float


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
    budget_seconds: float = TICK_BUDGET_SECONDS,
) -> TickSummary:
    """One worker tick on `conn` (a drain_connection). `should_stop` is checked between projects
    (graceful cancellation: the project in hand commits or rolls back whole, the rest stays
    queued); a project still running `stop_grace_seconds` after the stop is cancelled. The tick's
    own budget ends it the same way: it stops claiming `stop_grace_seconds` before the end (at
    most half the budget) and cancels the project in hand at the end. `correlation_id` tags every
    log line of the tick (a Dagster run passes its run id and tick number)."""
    started = time.perf_counter()
    grace = min(stop_grace_seconds, budget_seconds / 2)
    stopping = Budget(budget_seconds - grace, should_stop).stopping
    summary = TickSummary(correlation_id=correlation_id or uuid.uuid4().hex)
    with tracer().start_as_current_span(
        "recalc.tick", attributes={"correlationId": summary.correlation_id}
    ):
        if batch_size is None:
            configured = Q.batch_size(conn)
            batch_size = DEFAULT_BATCH_SIZE if configured is None else int(configured)
        _settle_abandoned_claims(conn, summary.correlation_id)
        summary.due_at_start = int(Q.count_due_requests(conn))
        # A tick with nothing due logs at DEBUG: a run waiting for rows about to fall due ticks
        # every second, and those lines were most of its compute log (issue 15).
        quiet = logging.DEBUG if summary.due_at_start == 0 else logging.INFO
        log_event(
            log,
            "recalc_batch_started",
            level=quiet,
            correlation_id=summary.correlation_id,
            size=min(summary.due_at_start, batch_size),
            due=summary.due_at_start,
        )
        with _cancelled_after_stop(conn, stopping, grace) as attempt_running:
            _run_batch(conn, summary, batch_size, stopping, attempt_running)
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
    if summary.poisoned:
        log_event(
            log,
            "CHESSBOARD_RECALC_POISON",
            level=logging.ERROR,
            correlation_id=summary.correlation_id,
            poisoned=summary.poisoned,
        )
    return summary


@dataclass(frozen=True)
class _AbandonedClaim:
    """A claim whose drain died inside the attempt, now counted (settle_abandoned_claims)."""

    project_id: UUID
    attempt_count: int
    last_error: str


def _settle_abandoned_claims(conn: psycopg.Connection, correlation_id: str) -> None:
    """Count the attempts of drains that died inside them as the failed runs they were."""
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


@dataclass(frozen=True)
class _Claim:
    """A claimed queue row (claim_due_request), with what release_claim needs to give it back."""

    project_id: UUID
    tenant_id: UUID
    last_reason: str
    requested_count: int
    #: Failed runs before this attempt.
    attempt_count: int
    waited_seconds: float
    #: The claim's identity: lock_claimed_request and release_claim match on it.
    claimed_at: datetime
    previous_attempted_at: datetime | None

    def release_params(self) -> dict[str, Any]:
        return {
            "project_id": self.project_id,
            "claimed_at": self.claimed_at,
            "previous_attempted_at": self.previous_attempted_at,
        }

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


@dataclass(frozen=True)
class _Step:
    """What recalc_project_step did with a claimed project, and the tick's next claim, claimed
    in the same transaction (migration 0014; next_* are NULL when none was asked for or ready)."""

    outcome: Literal["recalculated", "skipped_archived", "deferred", "failed"]
    #: The work, from the statement's start to its outcome recorded (the histogram's).
    duration_seconds: float
    buildings_written: int | None
    layouts_published: int | None
    layout_groups_published: int | None
    projects_published: int | None
    #: A failure as stored in last_error: psycopg's exception name for its SQLSTATE, then the
    #: error as libpq prints it, at most 1024 characters.
    error: str | None
    #: A failed project's failed runs, this one included.
    attempt_count: int | None
    next_project_id: UUID | None
    next_tenant_id: UUID | None
    next_last_reason: str | None
    next_requested_count: int | None
    next_attempt_count: int | None
    next_waited_seconds: float | None
    next_claimed_at: datetime | None
    next_previous_attempted_at: datetime | None

    def next_claim(self) -> _Claim | None:
        """The tick's next claim: the next_* columns are _Claim's fields."""
        if self.next_project_id is None:
            return None
        return _Claim(**{f.name: getattr(self, f"next_{f.name}") for f in fields(_Claim)})

    def result(self, claim: _Claim) -> ProjectResult:
        if self.outcome == "recalculated":
            return ProjectResult(
                claim.project_id,
                "recalculated",
                self.duration_seconds,
                republished={
                    "layout": self.layouts_published or 0,
                    "layout_group": self.layout_groups_published or 0,
                    "project": self.projects_published or 0,
                },
                buildings_updated=self.buildings_written or 0,
                requested_count=claim.requested_count,
            )
        if self.outcome == "skipped_archived":
            return ProjectResult(
                claim.project_id,
                "skipped_archived",
                self.duration_seconds,
                requested_count=claim.requested_count,
            )
        if self.outcome == "deferred":
            return ProjectResult(claim.project_id, "deferred", self.duration_seconds)
        return ProjectResult(
            claim.project_id,
            "failed",
            self.duration_seconds,
            error=self.error,
            attempt_count=self.attempt_count,
        )


#: Outcomes that leave the project's queue row in place for a later tick.
_STILL_QUEUED = frozenset({"failed", "deferred"})

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
) -> Iterator[threading.Event]:
    """Watches `should_stop` while the tick runs: once it holds for `grace` seconds and a
    project's attempt is still running (the yielded event is set), that attempt's statement is
    cancelled. Nothing is cancelled between attempts, where the stop is simply obeyed."""
    attempt_running = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if should_stop():
                if not done.wait(grace) and attempt_running.is_set():
                    conn.cancel_safe()
                return

    watcher = threading.Thread(target=watch, name="drain-stop-watch", daemon=True)
    watcher.start()
    try:
        yield attempt_running
    finally:
        done.set()
        watcher.join()


def _run_batch(
    conn: psycopg.Connection,
    summary: TickSummary,
    batch_size: int,
    stopping: Callable[[], bool],
    attempt_running: threading.Event,
) -> None:
    """Up to `batch_size` projects, one claimed at a time: the first alone, each next one by the
    previous project's work transaction. A claim still in hand when the batch ends (a stop
    between projects, an exception) is given back."""
    claim: _Claim | None = None
    # A row already tried in this tick (failed, or deferred on a lock) waits for the next one;
    # only those rows are still queued (the others were deleted), so only they are excluded: a
    # list of every project done, dumped with each claim, cost the drain ~0.08 ms per project at
    # a batch of 50.
    attempted: list[UUID] = []
    try:
        for done in range(batch_size):
            if stopping():
                summary.stopped_early = True
                break
            # The first claim commits on its own (autocommit), before the work: a drain that
            # dies inside the project has still counted the attempt.
            if claim is None:
                claim = fetch_one(Q.claim_due_request, conn, _Claim, attempted=attempted)
                if claim is None:
                    break
            in_hand, claim = claim, None
            claim_next = done + 1 < batch_size and not stopping()
            result, claim = _process(
                conn,
                summary.correlation_id,
                in_hand,
                attempted,
                claim_next,
                stopping,
                attempt_running,
            )
            summary.results.append(result)
            if result.outcome in _STILL_QUEUED:
                attempted.append(result.project_id)
            if result.outcome == "interrupted":
                summary.stopped_early = True
                break
    finally:
        if claim is not None:
            _give_back(conn, claim, claim.log_fields(summary.correlation_id))


def _process(
    conn: psycopg.Connection,
    correlation_id: str,
    claim: _Claim,
    attempted: list[UUID],
    claim_next: bool,
    should_stop: Callable[[], bool],
    attempt_running: threading.Event,
) -> tuple[ProjectResult, _Claim | None]:
    """One claimed project, in its span; its result, and the next claim when one was asked for
    and a project is ready."""
    fields = claim.log_fields(correlation_id)
    started = time.perf_counter()
    attempt_running.set()
    span = tracer().start_as_current_span(
        "recalc.project", attributes=claim.span_attributes(correlation_id)
    )
    next_claim: _Claim | None = None
    try:
        with span:
            step = _attempt(conn, claim, attempted, claim_next)
        result, next_claim = step.result(claim), step.next_claim()
    except pg_errors.LockNotAvailable:
        # The claimed row's lock waited past lock_timeout for a raiser's upsert of it (an edit
        # in flight since the claim's commit): contention, like a lock wait inside the
        # project, defers it with its attempt given back, and the tick goes on (spec: continue
        # over the batch), instead of failing the whole run.
        _give_back(conn, claim, fields)
        result = ProjectResult(claim.project_id, "deferred", time.perf_counter() - started)
    except pg_errors.QueryCanceled:
        if not should_stop():
            raise
        _give_back(conn, claim, fields)
        result = ProjectResult(claim.project_id, "interrupted", time.perf_counter() - started)
    except BaseException:
        # Interrupted some other way (KeyboardInterrupt, a Dagster run terminated from the UI):
        # the work rolled back, so the attempt is given back before the interruption goes on.
        _give_back(conn, claim, fields)
        raise
    finally:
        attempt_running.clear()
    event, level = _OUTCOME_EVENTS[result.outcome]
    log_event(log, event, level=level, **fields, **_outcome_fields(claim, result))
    return result, next_claim


def _outcome_fields(claim: _Claim, result: ProjectResult) -> dict[str, Any]:
    """What an outcome's log line adds to the claim's fields. A recalculated project: the spec's
    fields (duration, republished counts) and the wait; a line per project is most of a drain
    run's compute log, so nothing more."""
    if result.outcome == "recalculated":
        return {
            "duration_seconds": round(result.duration_seconds, 4),
            "republished": result.republished,
            "waited_seconds": round(claim.waited_seconds, 1),
        }
    if result.outcome == "failed":
        return {"attempt_count": result.attempt_count, "error": result.error}
    if result.outcome == "deferred":
        return {"reason": "row lock held elsewhere"}
    if result.outcome == "interrupted":
        return {"reason": "the drain is stopping, or the tick's budget is spent"}
    return {}


def _attempt(
    conn: psycopg.Connection, claim: _Claim, attempted: list[UUID], claim_next: bool
) -> _Step:
    """The work transaction of one claimed project, one statement in autocommit
    (recalc_project_step): the work, its outcome recorded while it still holds the claimed row (a
    failure's work rolled back to the function's savepoint), the counters, and the next claim.
    A stop's cancel and a lock wait on the claimed row itself leave it as exceptions, the whole
    statement rolled back. (psycopg's pipeline mode, sending BEGIN with the call and the counters
    with COMMIT when they were statements of their own, measured no faster in bench_recalc, and
    a lost connection then logged a warning line per queued statement.)"""
    step = fetch_one(
        Q.recalc_project_step,
        conn,
        _Step,
        project_id=claim.project_id,
        claimed_at=claim.claimed_at,
        previous_attempted_at=claim.previous_attempted_at,
        requested_count=claim.requested_count,
        traceparent=current_traceparent(),
        lock_share=LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT,
        claim_next=claim_next,
        attempted=attempted,
    )
    assert step is not None  # the function returns one row
    return step


def _give_back(conn: psycopg.Connection, claim: _Claim, fields: dict[str, Any]) -> None:
    """Best effort after an interrupted attempt: with the connection gone, the claim stays, and
    the next tick counts it as a failed run, as for a drain that died."""
    if conn.closed or conn.broken:
        return
    try:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        Q.release_claim(conn, **claim.release_params())
    except psycopg.Error as exc:
        log_event(
            log,
            "project_claim_not_released",
            level=logging.WARNING,
            **fields,
            error=first_line(exc),
        )


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
        total = replace(first, results=list(first.results))
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


def seconds_until_next_due(dsn: str, *, beat_as: str | None = None) -> float | None:
    """<= 0: a row is due now; None: nothing (non-poisoned) is queued.

    `beat_as` names a scheduler asking on its tick: its beat is recorded on the same connection,
    so liveness costs no connection of its own (CHESSBOARD_RECALC_WORKER_DOWN).
    """
    with connection(dsn, autocommit=True) as conn:
        if beat_as is not None:
            Q.record_scheduler_beat(conn, scheduler=beat_as)
        return _seconds_until_next_due(conn)


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
