"""The edit load under `pin serve`: a worker process editing at a steady rate, and what it saw of
each edit's way to its project's aggregates."""

from __future__ import annotations

import multiprocessing
import random
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg

from .databases import Q


@dataclass
class _Edit:
    committed: float
    due_at: float
    fresh: bool  # this edit opened its project's debounce window


@dataclass
class EditResults:
    """What the edit load saw. Lags (seconds) only of edits committed after the warm-up."""

    committed: list[float] = field(default_factory=list)
    #: commit → aggregates updated, for an edit that opened its project's debounce window and
    #: was the only edit of its recompute: the debounce plus the pipeline's delay.
    lag_isolated: list[float] = field(default_factory=list)
    #: commit → aggregates updated for every edit: with edits every few seconds on the big
    #: projects, the trailing debounce and the 5-minute starvation cap are in here by design.
    lag_any: list[float] = field(default_factory=list)
    #: recompute start − the due_at the project's last included edit left: the pipeline's own
    #: delay (sensor tick, run launch, queue), whatever the debounce did.
    delay_after_due: list[float] = field(default_factory=list)
    #: (commit time, lag) of every resolved edit, for per-minute lags.
    resolved: list[tuple[float, float]] = field(default_factory=list)
    unresolved: int = 0


@dataclass
class EditLoad:
    """The parameters of one edit load (a worker process)."""

    dsn: str
    pool: list[tuple[UUID, UUID]]
    rate: float
    seconds: float
    warmup_seconds: float
    settle_seconds: float


def edit_pool(dsn: str, edits: int) -> list[tuple[UUID, UUID]]:
    """(object, project) pairs of random Free objects, in random order: projects are edited in
    proportion to their size, as sales are. (The sample comes in table order, where a project's
    objects are neighbours: unshuffled, the edits would sweep through one project after another
    and coalesce far more than real ones.)"""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM chessboard.property_objects"
            " WHERE status = 'Free' AND deleted_at IS NULL"
        ).fetchone()
        percent = min(100.0, 130.0 * edits / max(1, int(row[0]) if row else 1))
        pool = [(r[0], r[1]) for r in Q.edit_pool(conn, percent=percent)]
    if len(pool) < edits:
        raise SystemExit(f"only {len(pool)} free objects for {edits} edits")
    random.shuffle(pool)
    return pool


def edit_load(
    load: EditLoad,
    ready: multiprocessing.Queue[list[int]],
    go: Any,
    progress: Any,
    out: multiprocessing.Queue[EditResults],
) -> None:
    """A worker process: `rate` edits/s for `seconds`, each a sale (status Sold) or, every
    fourth, a withdrawal (Hidden) of one Free object, so the recompute after an edit always moves
    its project's free count and updated_at. Each edit reads its queue row back in its own
    transaction (due_at, and whether it opened the debounce window). A second connection polls
    the edited projects' updated_at twice a second; after the load, until every edit is seen or
    `settle_seconds` pass."""
    results = EditResults()
    edit_conn = psycopg.connect(load.dsn)
    poll_conn = psycopg.connect(load.dsn, autocommit=True)
    ready.put([edit_conn.info.backend_pid, poll_conn.info.backend_pid])
    go.wait()
    pending: dict[UUID, list[_Edit]] = {}
    start = time.time()
    measure_from = start + load.warmup_seconds
    stop_loading = start + load.seconds
    next_poll = start
    i = 0

    def poll() -> None:
        rows = poll_conn.execute(
            "SELECT id, extract(epoch FROM updated_at)::float8 FROM chessboard.projects"
            " WHERE id = ANY(%s)",
            (list(pending),),
        ).fetchall()
        for project_id, updated in rows:
            done = [e for e in pending[project_id] if e.committed < updated]
            if not done:
                continue
            pending[project_id] = [e for e in pending[project_id] if e.committed >= updated]
            if not pending[project_id]:
                del pending[project_id]
            last = max(done, key=lambda e: e.committed)
            if last.committed >= measure_from:
                results.delay_after_due.append(updated - last.due_at)
            for e in done:
                if e.committed >= measure_from:
                    results.lag_any.append(updated - e.committed)
                    results.resolved.append((e.committed, updated - e.committed))
                    if len(done) == 1 and e.fresh:
                        results.lag_isolated.append(updated - e.committed)

    while True:
        now = time.time()
        if now < stop_loading and now >= start + i / load.rate:
            object_id, project_id = load.pool[i % len(load.pool)]
            i += 1
            changed = edit_conn.execute(
                "UPDATE chessboard.property_objects SET status = %s, version = version + 1,"
                " updated_at = now() WHERE id = %s AND status = 'Free'",
                ("Hidden" if i % 4 == 0 else "Sold", object_id),
            ).rowcount
            queued = edit_conn.execute(
                "SELECT extract(epoch FROM due_at)::float8, requested_count"
                " FROM chessboard.project_recalc_requests WHERE project_id = %s",
                (project_id,),
            ).fetchone()
            edit_conn.commit()
            if changed and queued is not None:
                committed = time.time()
                results.committed.append(committed)
                progress.value += 1
                pending.setdefault(project_id, []).append(
                    _Edit(committed, float(queued[0]), queued[1] == 1)
                )
            continue
        if now >= next_poll:
            if pending:
                poll()
            if now >= stop_loading and (not pending or now >= stop_loading + load.settle_seconds):
                break
            next_poll = now + 0.5
        wake = min(next_poll, start + i / load.rate) if now < stop_loading else next_poll
        time.sleep(max(0.0, min(0.05, wake - time.time())))
    results.unresolved = sum(
        1 for edits in pending.values() for e in edits if e.committed >= measure_from
    )
    edit_conn.close()
    poll_conn.close()
    out.put(results)
