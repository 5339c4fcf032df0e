-- Named queries of the recalc drain (spec 000, "Алгоритм"). Parameters are :named (aiosql).
--
-- A project is two transactions. The claim (claim_due_request) commits on its own: it counts the
-- attempt and stamps attempted_at, so a drain that dies inside the project has still counted it
-- (migration 0006). The work transaction then locks the claimed row again (lock_claimed_request)
-- and holds it to its end.
--
-- Lock order inside one project's work transaction, always the same so drains cannot deadlock
-- each other: queue row (lock_claimed_request) → project row → buildings → layouts → layout
-- groups (all locked by lock_project, before any recalc_* statement updates the rows whose values
-- changed).

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

-- name: relax_commit_durability()^
-- For the claim's own transaction only (see drain.py): its commit does not wait for the WAL flush.
SELECT set_config('synchronous_commit', 'off', true);

-- name: settle_abandoned_claims()
-- First thing of a tick: claims whose drain died inside the attempt (OOM kill, a lost host) are
-- the failed runs they were. Such a claim's row is unlocked (a live drain holds its claimed row
-- FOR UPDATE from its work transaction on, so SKIP LOCKED passes over it) and older than
-- retry_interval (a live drain takes that lock within milliseconds of its claim's commit). A
-- drain that was only stalled that long finds its claim gone and defers the project
-- (lock_claimed_request). The counted row is ready again, or poison at poison_attempts.
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
-- commits it before the work starts): claimed_at marks the attempt in progress, attempted_at
-- starts the retry clock. No attempt is counted here: attempt_count is failed runs, counted by
-- record_failure, or by settle_abandoned_claims for a drain that died.
-- SKIP LOCKED: a row another drain is working on is passed over without waiting, so N drains
-- share the queue and no project is recalculated twice at once; a claimed row is not ready
-- (claimed_at) in the moment between another drain's claim and its work transaction either.
-- Poisoned rows (attempt_count at the threshold) are left for triage and can never block the
-- rows behind them.
-- `attempted` (uuid[]): projects this tick already tried; a failed or deferred row is retried
-- on a later tick (spec), never again in the same one however short retry_interval is; NULL
-- (pgbench, bench/) excludes nothing.
WITH ready AS (
    SELECT r.project_id, r.attempted_at
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
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

-- name: lock_claimed_request(project_id, claimed_at)$
-- First statement of the work transaction: the claimed row, locked until its end. NULL when the
-- row is no longer this claim's (deleted by hand, requeued, or settled as abandoned because this
-- drain stalled past retry_interval between its claim and this lock).
SELECT true FROM chessboard.project_recalc_requests
WHERE project_id = :project_id AND claimed_at = :claimed_at
FOR UPDATE;

-- name: release_claim(project_id, claimed_at, previous_attempted_at)!
-- An attempt that ended without a verdict on the project (deferred on a row lock, interrupted by
-- a stop) is given back: no attempt in progress, the retry clock as before the claim.
UPDATE chessboard.project_recalc_requests
SET claimed_at = NULL, attempted_at = :previous_attempted_at
WHERE project_id = :project_id AND claimed_at = :claimed_at;

-- name: limit_waits(statement_timeout, lock_share)^
-- For the rest of this project's transaction. lock_timeout is a share of deadlock_timeout (see
-- LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT in drain.py), read from the server so it stays below it
-- whatever the server is configured with. A drain that stops sending between two statements of
-- the transaction (stopped, or its host cut off) loses its session after statement_timeout, and
-- with it the project's row locks: another drain takes the project over.
SELECT set_config('statement_timeout', :statement_timeout, true),
       set_config('idle_in_transaction_session_timeout', :statement_timeout, true),
       set_config('lock_timeout', greatest(1, round(:lock_share * extract(epoch FROM
           current_setting('deadlock_timeout')::interval) * 1000))::int::text, true);

-- name: lock_project(project_id)^
-- The project's snapshot, and every row this transaction may write locked at once, in the lock
-- order above (project, then its buildings, layouts and layout groups). Any wait for a row an
-- HTTP edit holds therefore starts right after the claim, never after the longer recalc
-- statements: in a lock cycle with an edit whose raiser waits for the claimed queue row, the
-- drain's lock_timeout (half of deadlock_timeout) runs out before the edit's deadlock check, so
-- the drain defers and the edit goes through. NO KEY UPDATE is the lock the recalc's UPDATEs
-- take anyway; unlike FOR UPDATE it lets the API insert rows that reference these (a foreign key
-- takes KEY SHARE) without waiting. The counts are for logs and tests only.
WITH project AS (
    SELECT status, deleted_at FROM chessboard.projects WHERE id = :project_id FOR NO KEY UPDATE
), buildings AS (
    SELECT 1 FROM chessboard.buildings WHERE project_id = :project_id
    ORDER BY id FOR NO KEY UPDATE
), layouts AS (
    SELECT 1 FROM chessboard.layouts WHERE project_id = :project_id
    ORDER BY id FOR NO KEY UPDATE
), layout_groups AS (
    SELECT 1 FROM chessboard.layout_groups WHERE project_id = :project_id
    ORDER BY id FOR NO KEY UPDATE
)
SELECT status, deleted_at,
       (SELECT count(*) FROM buildings) AS buildings, (SELECT count(*) FROM layouts) AS layouts,
       (SELECT count(*) FROM layout_groups) AS layout_groups
FROM project;

-- name: recalc_buildings(project_id)$
-- Building counters are written but never published: they are not in the building event's payload.
WITH truth AS (
    SELECT b.id,
           count(po.id) FILTER (WHERE po.status <> 'Hidden') AS total,
           count(po.id) FILTER (WHERE po.status = 'Free') AS free
    FROM chessboard.buildings b
    LEFT JOIN chessboard.property_objects po
           ON po.building_id = b.id AND po.project_id = b.project_id AND po.deleted_at IS NULL
    WHERE b.project_id = :project_id
    GROUP BY b.id
), changed AS (
    UPDATE chessboard.buildings b
    SET property_objects_total_count = t.total, property_objects_free_count = t.free,
        version = b.version + 1, updated_at = now()
    FROM truth t
    WHERE b.id = t.id
      AND (b.property_objects_total_count, b.property_objects_free_count)
          IS DISTINCT FROM (t.total, t.free)
    RETURNING 1
)
SELECT count(*) FROM changed;

-- The three published entities below share one rule (contract section 4): a row whose snapshot
-- (its entity fields with the recomputed aggregates) differs from the one it last published, or
-- whose aggregate columns differ from the truth, gets Version + 1 and an event in the same
-- statement; any other row is left untouched, so a duplicate run writes nothing. The snapshot
-- covers the row's own fields too: a renamed, re-sorted or archived group, a renamed project
-- and a new row (published_snapshot NULL) are published although no aggregate moved.
-- `traceparent`: the project span's W3C context, carried with its events (NULL: not traced).

-- name: recalc_layouts(project_id, traceparent)$
-- Active objects per layout.
WITH truth AS (
    SELECT l.id, count(po.id)::int AS objects
    FROM chessboard.layouts l
    LEFT JOIN chessboard.property_objects po
           ON po.layout_id = l.id AND po.project_id = l.project_id
          AND po.deleted_at IS NULL AND po.status <> 'Hidden'
    WHERE l.project_id = :project_id
    GROUP BY l.id
), fresh AS (
    SELECT l.id, t.objects, chessboard.layout_snapshot(l, t.objects) AS snapshot
    FROM chessboard.layouts l JOIN truth t ON t.id = l.id
), changed AS (
    UPDATE chessboard.layouts l
    SET property_objects_count = f.objects, published_snapshot = f.snapshot,
        version = l.version + 1, updated_at = now()
    FROM fresh f
    WHERE l.id = f.id
      AND (l.property_objects_count IS DISTINCT FROM f.objects
           OR l.published_snapshot IS DISTINCT FROM f.snapshot)
    RETURNING l.id, l.version, l.published_snapshot
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
    SELECT 'pin.chessboard.layout-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot, :traceparent::text
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: recalc_layout_groups(project_id, traceparent)$
-- Live layouts per group and their area bounds.
WITH truth AS (
    SELECT g.id, count(l.id)::int AS layouts,
           min(l.total_area) AS area_min, max(l.total_area) AS area_max
    FROM chessboard.layout_groups g
    LEFT JOIN chessboard.layouts l
           ON l.layout_group_id = g.id AND l.project_id = g.project_id AND l.deleted_at IS NULL
    WHERE g.project_id = :project_id
    GROUP BY g.id
), fresh AS (
    SELECT g.id, t.layouts, t.area_min, t.area_max,
           chessboard.layout_group_snapshot(g, t.layouts, t.area_min, t.area_max) AS snapshot
    FROM chessboard.layout_groups g JOIN truth t ON t.id = g.id
), changed AS (
    UPDATE chessboard.layout_groups g
    SET layouts_count = f.layouts, area_min = f.area_min, area_max = f.area_max,
        published_snapshot = f.snapshot, version = g.version + 1, updated_at = now()
    FROM fresh f
    WHERE g.id = f.id
      AND ((g.layouts_count, g.area_min, g.area_max)
               IS DISTINCT FROM (f.layouts, f.area_min, f.area_max)
           OR g.published_snapshot IS DISTINCT FROM f.snapshot)
    RETURNING g.id, g.version, g.published_snapshot
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
    SELECT 'pin.chessboard.layout-group-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot, :traceparent::text
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: recalc_project(project_id, traceparent)$
-- Free-object price bounds and counters of the project.
WITH truth AS (
    SELECT (count(*) FILTER (WHERE po.status <> 'Hidden'))::int AS total,
           (count(*) FILTER (WHERE po.status = 'Free'))::int AS free,
           min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
           max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
    FROM chessboard.property_objects po
    WHERE po.project_id = :project_id AND po.deleted_at IS NULL
), fresh AS (
    SELECT p.id, t.total, t.free, t.price_min, t.price_max,
           chessboard.project_snapshot(p, t.total, t.free, t.price_min, t.price_max) AS snapshot
    FROM chessboard.projects p, truth t
    WHERE p.id = :project_id
), changed AS (
    UPDATE chessboard.projects p
    SET property_objects_total_count = f.total, property_objects_free_count = f.free,
        price_min = f.price_min, price_max = f.price_max, published_snapshot = f.snapshot,
        version = p.version + 1, updated_at = now()
    FROM fresh f
    WHERE p.id = f.id
      AND ((p.property_objects_total_count, p.property_objects_free_count, p.price_min,
            p.price_max) IS DISTINCT FROM (f.total, f.free, f.price_min, f.price_max)
           OR p.published_snapshot IS DISTINCT FROM f.snapshot)
    RETURNING p.id, p.version, p.published_snapshot
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
    SELECT 'pin.chessboard.project-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot, :traceparent::text
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: delete_request(project_id)!
-- Closes the debounce window in the same transaction as the recalc: a request that arrives
-- from now on waits for this commit and then inserts a fresh row.
DELETE FROM chessboard.project_recalc_requests WHERE project_id = :project_id;

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
