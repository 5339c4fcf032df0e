-- Named queries of the recalc drain (spec 000, "Алгоритм"). Parameters are :named (aiosql).
--
-- A project's claim is committed before its work starts, so a drain that dies inside the
-- project has still marked the attempt (schema/recalc.sql). A tick's projects run in one CALL
-- (recalc_tick): its first claim commits on its own; every project's
-- work transaction then locks the claimed row again and holds it to its end, records the
-- outcome, and claims the tick's next project in the same COMMIT.
--
-- Lock order inside one project's work transaction, always the same so drains cannot deadlock
-- each other: queue row → project row → buildings → layouts → layout groups (all locked before
-- any recalc statement updates the rows whose values changed); the next project's queue row is
-- claimed last, with SKIP LOCKED, which never waits.

-- Every aggregate is a function of its own project's rows only (spec step 4: "по ProjectId = @p"):
-- an object counts for a building or layout, and a layout for a group, only when both carry the
-- same project_id. The raisers enqueue the old and new project_id of every edited row, so a row
-- that references another project's building/layout/group can never leave that project's
-- aggregates stale (that project is not queued by the edit, and its values do not depend on it).

-- A queue row's states (poisoned, due, ready, ready_at) are functions of the row in
-- schema/queue.sql, used here by name.

-- name: count_due_requests()$
-- Due rows at the start of a tick (logged by recalc_batch_started): the due backlog without
-- poisoned rows (chessboard_recalc_due_backlog_unpoisoned), so a row overdue while it waits for
-- a retry or runs in another drain shows.
SELECT count(*)
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE chessboard.recalc_request_due(r, s);

-- name: tick_settings()^
-- Projects per tick when the caller does not say, and the failed runs that make a row poison (no
-- row without a settings row: the drain's default batch, and no row is ever poison).
SELECT batch_size, poison_attempts FROM chessboard.recalc_settings;

-- name: settle_abandoned_claims()
-- First thing of a tick: claims whose drain died inside the attempt (OOM kill, a lost host) are
-- the failed runs they were. Such a claim's row is unlocked (a live drain holds its claimed row
-- FOR UPDATE from its work transaction on, so SKIP LOCKED passes over it) and older than
-- retry_interval (a live drain takes that lock within milliseconds of its claim's commit). A
-- drain that was only stalled that long finds its claim gone and defers the project
-- (recalc_claimed_project). The counted row is ready again, or poison at poison_attempts.
-- Returns the claims counted as abandoned.
--
-- Before that, the ends of attempts a writer kept from their rows (recalc_pending_claim_ends,
-- written by recalc_tick's handlers through chessboard.end_claim) are applied to the rows now
-- free, as the handler would have: the claim given back, or the statement timeout's failed run
-- (reported by the tick that timed out); such a claim is never counted as abandoned. A row the
-- writer still holds is passed over (SKIP LOCKED) and keeps its claim, so it is not claimed
-- again before a later tick settles it. Pending ends whose claim is no longer the row's (settled
-- as abandoned before the end was committed, requeued, or the row gone) are forgotten.
WITH ending AS (
    SELECT e.project_id, e.claimed_at, e.previous_attempted_at, e.error
    FROM chessboard.recalc_pending_claim_ends e
    JOIN chessboard.project_recalc_requests r
      ON r.project_id = e.project_id AND r.claimed_at = e.claimed_at
    FOR UPDATE OF r SKIP LOCKED
), ended AS (
    UPDATE chessboard.project_recalc_requests r
    SET claimed_at = NULL,
        attempted_at = CASE WHEN e.error IS NULL THEN e.previous_attempted_at
                            ELSE r.attempted_at END,
        attempt_count = r.attempt_count + CASE WHEN e.error IS NULL THEN 0 ELSE 1 END,
        last_error = coalesce(e.error, r.last_error),
        updated_at = CASE WHEN e.error IS NULL THEN r.updated_at ELSE now() END
    FROM ending e
    WHERE r.project_id = e.project_id
), forgotten AS (
    DELETE FROM chessboard.recalc_pending_claim_ends e
    WHERE (e.project_id, e.claimed_at) IN (SELECT n.project_id, n.claimed_at FROM ending n)
       OR NOT EXISTS (SELECT 1 FROM chessboard.project_recalc_requests r
                      WHERE r.project_id = e.project_id AND r.claimed_at = e.claimed_at)
), abandoned AS (
    SELECT r.project_id
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE r.claimed_at IS NOT NULL AND r.claimed_at + s.retry_interval <= now()
      AND NOT EXISTS (SELECT 1 FROM chessboard.recalc_pending_claim_ends e
                      WHERE e.project_id = r.project_id AND e.claimed_at = r.claimed_at)
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE chessboard.project_recalc_requests r
SET attempt_count = r.attempt_count + 1, claimed_at = NULL, updated_at = now(),
    last_error = 'attempt ' || r.attempt_count + 1 || ' started at ' || r.claimed_at
                 || ' and never ended: the drain died inside it'
FROM abandoned
WHERE r.project_id = abandoned.project_id
RETURNING r.project_id, r.attempt_count, r.last_error;

-- name: recalc_tick(batch, claim_for, attempted, traceparents, lock_share)$
-- Up to `batch` projects in one CALL, each in a transaction of its own
-- (chessboard.recalc_tick, schema/recalc.sql): the first claim commits alone (claim_due_request: one ready row,
-- oldest due_at first, SKIP LOCKED, claimed_at marking the attempt in progress, attempted_at
-- starting the retry clock; no attempt counted there), then per project the work, its outcome
-- recorded and the next claim in one COMMIT (recalc_project_step), while
-- `claim_for` (an interval) has not passed since the call started. Returns one JSON object per
-- project: the claim and what became of it (drain._ProjectReport).
-- SKIP LOCKED: a row another drain is working on is passed over without waiting, so N drains
-- share the queue and no project is recalculated twice at once; a claimed row is not ready
-- (claimed_at) in the moment between another drain's claim and its work either. Poisoned rows
-- (attempt_count at the threshold) are left for triage and never block the rows behind them.
-- `attempted` (uuid[]): projects this tick already tried; a failed or deferred row is retried on
-- a later tick (spec), never again in the same one however short retry_interval is.
-- `traceparents` (text[]): the n-th project's span context, stamped into its events; NULL when
-- nothing is traced.
CALL chessboard.recalc_tick(:batch, :claim_for, :attempted::uuid[], :traceparents::text[],
                            :lock_share, NULL);

-- name: poisoned_requests()
-- Rows parked for triage (runbook: fix the data, then requeue).
SELECT r.project_id, r.tenant_id, r.attempt_count, r.last_error, r.last_reason,
       r.first_requested_at, r.updated_at
FROM chessboard.poisoned_recalc_requests() r
ORDER BY r.attempted_at;

-- name: beat_and_next_due_in_seconds(scheduler)$
-- The scheduler's tick (the Dagster sensor's evaluation), due rows or not: its liveness beat and
-- the seconds until the next row is ready, in one statement (one transaction per tick; the
-- WITH's INSERT runs whether or not the SELECT reads it).
WITH beat AS (
    INSERT INTO chessboard.recalc_scheduler_beats AS b (scheduler, beats, last_beat_at)
    VALUES (:scheduler, 1, now())
    ON CONFLICT (scheduler) DO UPDATE SET
        beats = b.beats + 1, last_beat_at = greatest(b.last_beat_at, excluded.last_beat_at)
)
SELECT chessboard.recalc_next_due_in_seconds();

-- name: next_due_in_seconds()$
-- Seconds until the next row is ready (<= 0: now; NULL: nothing but poison is queued).
SELECT chessboard.recalc_next_due_in_seconds();

-- name: project_exists(project_id)$
-- The runbook's force-recalc refuses an unknown project (force_request would insert nothing).
SELECT true FROM chessboard.projects WHERE id = :project_id;

-- name: force_request(project_id, reason)!
-- Runbook "ручной форс-пересчёт": the row becomes due now, whatever its debounce said.
INSERT INTO chessboard.project_recalc_requests AS r
    (project_id, tenant_id, due_at, first_requested_at, requested_count, last_reason)
SELECT p.id, p.tenant_id, now(), now(), 1, :reason
FROM chessboard.projects p WHERE p.id = :project_id
ON CONFLICT ON CONSTRAINT project_recalc_requests_pkey DO UPDATE SET
    due_at = now(), requested_count = r.requested_count + 1,
    last_reason = excluded.last_reason, updated_at = now();

-- name: requeue_request(project_id)$
-- Runbook for a poison row: forget the failures and make it due now. Returns 1 when requeued.
WITH requeued AS (
    UPDATE chessboard.project_recalc_requests
    SET attempt_count = 0, attempted_at = NULL, claimed_at = NULL, last_error = NULL,
        due_at = now(), updated_at = now()
    WHERE project_id = :project_id
    RETURNING 1
)
SELECT count(*) FROM requeued;

-- name: count_poisoned()$
SELECT count(*) FROM chessboard.poisoned_recalc_requests();

-- Counters of the drain, read by the exporter (metrics.sql). They are written inside the
-- transaction of the work they count (recalc_project_step, with record_recalc_outcome of
-- schema/metrics.sql), so a rolled-back project counts nothing and a committed one counts exactly
-- once, whichever process ran it. Each session writes its own shard (mod(pg_backend_pid(), 16)):
-- concurrent drains do not queue on counter rows. The exporter sums the shards at scrape time.

-- name: fold_recalc_outcomes()!
-- A tick's end: the outcome rows its projects (and any other drain's) committed, added to
-- metric_counters in one transaction (schema/metrics.sql).
SELECT chessboard.fold_recalc_outcomes();

-- name: record_tick()!
-- Worker liveness: every drain tick, even one with nothing due, moves the timestamp.
INSERT INTO chessboard.recalc_worker_ticks AS t (shard, ticks, last_tick_at)
VALUES (mod(pg_backend_pid(), 16), 1, now())
ON CONFLICT (shard) DO UPDATE SET
    ticks = t.ticks + 1, last_tick_at = greatest(t.last_tick_at, excluded.last_tick_at);
