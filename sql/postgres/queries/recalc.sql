-- Named queries of the recalc drain (spec 000, "Алгоритм"). Parameters are :named (aiosql).
--
-- A project is two transactions. The claim (claim_due_request) commits on its own: it counts the
-- attempt and stamps attempted_at, so a drain that dies inside the project has still counted it
-- (migration 0006). The work transaction then locks the claimed row again and holds it to its
-- end: recalc_claimed_project, one function call (migration 0013) for the work's steps.
--
-- Lock order inside one project's work transaction, always the same so drains cannot deadlock
-- each other: queue row → project row → buildings → layouts → layout groups (all locked before
-- any recalc statement updates the rows whose values changed).

-- Every aggregate is a function of its own project's rows only (spec step 4: "по ProjectId = @p"):
-- an object counts for a building or layout, and a layout for a group, only when both carry the
-- same project_id. The raisers enqueue the old and new project_id of every edited row, so a row
-- that references another project's building/layout/group can never leave that project's
-- aggregates stale (that project is not queued by the edit, and its values do not depend on it).

-- "Ready" below means: due, not poisoned, and no attempt started within retry_interval. The
-- interval runs from attempted_at, which only a claim writes: edits that keep arriving push
-- due_at (up to the starvation cap) and updated_at, but never postpone the retry of a failure.

-- name: count_due_requests()$
-- Due rows at the start of a tick (logged by recalc_batch_started): the due backlog, as the
-- metrics count it, so a row overdue while it waits for a retry or runs in another drain shows.
SELECT count(*)
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts;

-- name: batch_size()$
-- Projects per tick when the caller does not say (NULL without a settings row: the drain's default).
SELECT batch_size FROM chessboard.recalc_settings;

-- name: settle_abandoned_claims()
-- First thing of a tick: claims whose drain died inside the attempt (OOM kill, a lost host) are
-- the failed runs they were. Such a claim's row is unlocked (a live drain holds its claimed row
-- FOR UPDATE from its work transaction on, so SKIP LOCKED passes over it) and older than
-- retry_interval (a live drain takes that lock within milliseconds of its claim's commit). A
-- drain that was only stalled that long finds its claim gone and defers the project
-- (recalc_claimed_project). The counted row is ready again, or poison at poison_attempts.
WITH abandoned AS (
    SELECT r.project_id
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE r.claimed_at IS NOT NULL AND r.claimed_at + s.retry_interval <= now()
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE chessboard.project_recalc_requests r
SET attempt_count = r.attempt_count + 1, claimed_at = NULL, updated_at = now(),
    last_error = 'attempt ' || r.attempt_count + 1 || ' started at ' || r.claimed_at
                 || ' and never ended: the drain died inside it'
FROM abandoned
WHERE r.project_id = abandoned.project_id
RETURNING r.project_id, r.attempt_count, r.last_error;

-- name: claim_due_request(attempted)^
-- One ready row, oldest due_at first, stamped in this statement's own transaction (the caller
-- runs it alone, in autocommit, before the work starts; `relaxed` makes that commit not wait
-- for the WAL flush: only a server crash within a fraction of a second could forget the claim,
-- and the work transaction's commit flushes it anyway): claimed_at marks the attempt in
-- progress, attempted_at starts the retry clock. No attempt is counted here: attempt_count is failed runs, counted by
-- record_failure, or by settle_abandoned_claims for a drain that died.
-- SKIP LOCKED: a row another drain is working on is passed over without waiting, so N drains
-- share the queue and no project is recalculated twice at once; a claimed row is not ready
-- (claimed_at) in the moment between another drain's claim and its work transaction either.
-- Poisoned rows (attempt_count at the threshold) are left for triage and can never block the
-- rows behind them.
-- `attempted` (uuid[]): projects this tick already tried; a failed or deferred row is retried
-- on a later tick (spec), never again in the same one however short retry_interval is; NULL
-- (pgbench, bench/) excludes nothing.
WITH relaxed AS MATERIALIZED (
    SELECT set_config('synchronous_commit', 'off', true)
), ready AS (
    SELECT r.project_id, r.attempted_at
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s, relaxed
    WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts AND r.claimed_at IS NULL
      AND (r.attempted_at IS NULL OR r.attempted_at + s.retry_interval <= now())
      AND r.project_id <> ALL (coalesce(:attempted::uuid[], '{}'))
    ORDER BY r.due_at
    LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE chessboard.project_recalc_requests r
SET claimed_at = now(), attempted_at = now()
FROM ready
WHERE r.project_id = ready.project_id
RETURNING r.project_id, r.tenant_id, r.last_reason, r.requested_count, r.attempt_count,
          extract(epoch FROM now() - r.first_requested_at)::float8 AS waited_seconds,
          r.claimed_at, ready.attempted_at AS previous_attempted_at;

-- name: release_claim(project_id, claimed_at, previous_attempted_at)!
-- An attempt that ended without a verdict on the project (deferred on a row lock, interrupted by
-- a stop) is given back: no attempt in progress, the retry clock as before the claim.
UPDATE chessboard.project_recalc_requests
SET claimed_at = NULL, attempted_at = :previous_attempted_at
WHERE project_id = :project_id AND claimed_at = :claimed_at;

-- name: limit_waits(statement_timeout)^
-- For the drain's session, set once per tick. A drain that stops sending inside a transaction
-- (stopped, or its host cut off) loses its session after statement_timeout, and with it the
-- project's row locks: another drain takes the project over; a project that runs longer is
-- stuck, and is cancelled. Row lock waits are bounded by recalc_claimed_project itself.
SELECT set_config('statement_timeout', :statement_timeout, false),
       set_config('idle_in_transaction_session_timeout', :statement_timeout, false);

-- name: recalc_claimed_project(project_id, claimed_at, traceparent, lock_share)^
-- The work of one claimed project (migration 0013): the claimed row locked again, then in a
-- savepoint the project's rows locked, the four aggregate tables recomputed, the changed
-- snapshots published and the request deleted. Its outcome, counts and a failure's error are
-- the row; the caller's transaction holds the claimed row until it has recorded the outcome.
SELECT * FROM chessboard.recalc_claimed_project(:project_id, :claimed_at, :traceparent,
                                                :lock_share);

-- name: record_failure(project_id, error)$
-- After the project's work was rolled back (to a savepoint, so the row lock is still held): one
-- more failed run, its error, no attempt in progress. due_at stays, so a later tick retries, and
-- attempt_count at poison_attempts parks the row. Returns the new attempt_count.
UPDATE chessboard.project_recalc_requests
SET attempt_count = attempt_count + 1, last_error = left(:error, 1024), claimed_at = NULL,
    updated_at = now()
WHERE project_id = :project_id
RETURNING attempt_count;

-- name: poisoned_requests()
-- Rows parked for triage (runbook: fix the data, then requeue).
SELECT r.project_id, r.tenant_id, r.attempt_count, r.last_error, r.last_reason,
       r.first_requested_at, r.updated_at
FROM chessboard.poisoned_recalc_requests() r
ORDER BY r.attempted_at;

-- name: record_scheduler_beat(scheduler)!
-- Scheduler liveness: every evaluation of the scheduler (the Dagster sensor), due rows or not.
INSERT INTO chessboard.recalc_scheduler_beats AS b (scheduler, beats, last_beat_at)
VALUES (:scheduler, 1, now())
ON CONFLICT (scheduler) DO UPDATE SET
    beats = b.beats + 1, last_beat_at = greatest(b.last_beat_at, excluded.last_beat_at);

-- name: next_due_in_seconds()$
-- Seconds until the next row is ready (<= 0: now; NULL: nothing but poison is queued).
-- greatest() skips the NULL of a row never attempted.
SELECT extract(epoch FROM min(greatest(r.due_at, r.attempted_at + s.retry_interval))
               - now())::float8
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.attempt_count < s.poison_attempts;

-- name: request_project_recalc(project_id, tenant_id, reason)!
-- An explicit raiser, in the caller's transaction: the same debounced upsert the triggers call
-- (migration 0001).
SELECT chessboard.request_project_recalc(:project_id, :tenant_id, :reason);

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

-- Counters of the drain, read by the exporter (metrics.sql). They run inside the transaction of
-- the work they count, so a rolled-back project counts nothing and a committed one counts exactly
-- once, whichever process ran it. Each session writes its own shard (mod(pg_backend_pid(), 16)):
-- concurrent drains do not queue on counter rows. The exporter sums the shards at scrape time.

-- name: record_recalc_outcome(result, duration, coalesced, project, layout, layout_group)!
-- One claimed project: runs_total{result}, the events it coalesced, the snapshots it republished
-- per entity and (when duration is not NULL) one histogram observation. Zero increments are not
-- written; the exporter serves every known label with 0 until it is first counted. Rows are
-- upserted in key order, so two sessions sharing a shard cannot deadlock.
INSERT INTO chessboard.metric_counters AS c (metric, label, shard, value)
SELECT d.metric, d.label, mod(pg_backend_pid(), 16), d.value
FROM (VALUES
    ('runs', :result::text, 1::float8),
    ('coalesced_events', '', :coalesced::float8),
    ('republished', 'project', :project::float8),
    ('republished', 'layout', :layout::float8),
    ('republished', 'layout_group', :layout_group::float8),
    ('duration_sum', '', :duration::float8),
    ('duration_bucket',
     coalesce((SELECT min(b.le) FROM chessboard.recalc_duration_buckets b
               WHERE b.le >= :duration::float8)::text, '+Inf'),
     CASE WHEN :duration::float8 IS NULL THEN 0 ELSE 1 END)
) AS d (metric, label, value)
WHERE d.value <> 0
ORDER BY d.metric, d.label
ON CONFLICT (metric, label, shard) DO UPDATE SET value = c.value + excluded.value;

-- name: record_tick()!
-- Worker liveness: every drain tick, even one with nothing due, moves the timestamp.
INSERT INTO chessboard.recalc_worker_ticks AS t (shard, ticks, last_tick_at)
VALUES (mod(pg_backend_pid(), 16), 1, now())
ON CONFLICT (shard) DO UPDATE SET
    ticks = t.ticks + 1, last_tick_at = greatest(t.last_tick_at, excluded.last_tick_at);
