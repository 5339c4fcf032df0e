-- Named queries of the recalc drain (spec 000, "Алгоритм"). Parameters are :named (aiosql).
--
-- Lock order inside one project's transaction, always the same so drains cannot deadlock each
-- other: queue row (claim_due_request) → project row → buildings → layouts → layout groups (all
-- locked by lock_project, before any recalc_* statement updates the rows whose values changed).

-- Every aggregate is a function of its own project's rows only (spec step 4: "по ProjectId = @p"):
-- an object counts for a building or layout, and a layout for a group, only when both carry the
-- same project_id. The raisers enqueue the old and new project_id of every edited row, so a row
-- that references another project's building/layout/group can never leave that project's
-- aggregates stale (that project is not queued by the edit, and its values do not depend on it).

-- "Ready" below means: due, not poisoned, and (after a failure) past its retry interval.

-- name: count_due_requests()$
-- Ready rows at the start of a tick: the size logged by recalc_batch_started.
SELECT count(*)
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts
  AND (r.attempt_count = 0 OR r.updated_at + s.retry_interval <= now());

-- name: claim_due_request(attempted)^
-- One due row, oldest due_at first, locked for the rest of this project's transaction.
-- SKIP LOCKED: a row another drain is working on is passed over without waiting, so N drains
-- share the queue and no project is recalculated twice at once. Poisoned rows (attempt_count
-- at the threshold) are left for triage and can never block the rows behind them.
-- `attempted` (uuid[]): projects this tick already tried; a failed or deferred row is retried
-- on a later tick (spec), never again in the same one however short retry_interval is; NULL
-- (pgbench, bench/) excludes nothing.
SELECT r.project_id, r.tenant_id, r.last_reason, r.requested_count, r.attempt_count,
       extract(epoch FROM now() - r.first_requested_at)::float8 AS waited_seconds
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts
  AND (r.attempt_count = 0 OR r.updated_at + s.retry_interval <= now())
  AND r.project_id <> ALL (coalesce(:attempted::uuid[], '{}'))
ORDER BY r.due_at
LIMIT 1
FOR UPDATE OF r SKIP LOCKED;

-- name: limit_waits(statement_timeout, lock_share)^
-- For the rest of this project's transaction. lock_timeout is a share of deadlock_timeout (see
-- LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT in drain.py), read from the server so it stays below it
-- whatever the server is configured with.
SELECT set_config('statement_timeout', :statement_timeout, true),
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
       (SELECT count(*) FROM buildings), (SELECT count(*) FROM layouts),
       (SELECT count(*) FROM layout_groups)
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

-- name: recalc_layouts(project_id)$
-- Active objects per layout; a snapshot event for every layout whose count changed.
WITH truth AS (
    SELECT l.id, count(po.id) AS objects
    FROM chessboard.layouts l
    LEFT JOIN chessboard.property_objects po
           ON po.layout_id = l.id AND po.project_id = l.project_id
          AND po.deleted_at IS NULL AND po.status <> 'Hidden'
    WHERE l.project_id = :project_id
    GROUP BY l.id
), changed AS (
    UPDATE chessboard.layouts l
    SET property_objects_count = t.objects, version = l.version + 1, updated_at = now()
    FROM truth t
    WHERE l.id = t.id AND l.property_objects_count IS DISTINCT FROM t.objects
    RETURNING l.*
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || jsonb_build_object(
               'ProjectId', c.project_id,
               'LayoutGroupId', c.layout_group_id,
               'Name', c.name,
               'TotalArea', c.total_area,
               'PropertyObjectsCount', c.property_objects_count,
               'IsDeleted', c.deleted_at IS NOT NULL)
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: recalc_layout_groups(project_id)$
-- Live layouts per group and their area bounds; an event for every group whose values changed.
WITH truth AS (
    SELECT g.id, count(l.id) AS layouts,
           min(l.total_area) AS area_min, max(l.total_area) AS area_max
    FROM chessboard.layout_groups g
    LEFT JOIN chessboard.layouts l
           ON l.layout_group_id = g.id AND l.project_id = g.project_id AND l.deleted_at IS NULL
    WHERE g.project_id = :project_id
    GROUP BY g.id
), changed AS (
    UPDATE chessboard.layout_groups g
    SET layouts_count = t.layouts, area_min = t.area_min, area_max = t.area_max,
        version = g.version + 1, updated_at = now()
    FROM truth t
    WHERE g.id = t.id
      AND (g.layouts_count, g.area_min, g.area_max)
          IS DISTINCT FROM (t.layouts, t.area_min, t.area_max)
    RETURNING g.*
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-group-upserted.v1', c.id::text,
           chessboard.layout_group_payload(c)
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: recalc_project(project_id)$
-- Free-object price bounds and counters of the project; an event when any of them changed.
WITH truth AS (
    SELECT count(*) FILTER (WHERE po.status <> 'Hidden') AS total,
           count(*) FILTER (WHERE po.status = 'Free') AS free,
           min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
           max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
    FROM chessboard.property_objects po
    WHERE po.project_id = :project_id AND po.deleted_at IS NULL
), changed AS (
    UPDATE chessboard.projects p
    SET property_objects_total_count = t.total, property_objects_free_count = t.free,
        price_min = t.price_min, price_max = t.price_max,
        version = p.version + 1, updated_at = now()
    FROM truth t
    WHERE p.id = :project_id
      AND (p.property_objects_total_count, p.property_objects_free_count, p.price_min, p.price_max)
          IS DISTINCT FROM (t.total, t.free, t.price_min, t.price_max)
    RETURNING p.*
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.project-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || jsonb_build_object(
               'TenantId', c.tenant_id,
               'Name', c.name,
               'Status', c.status,
               'PriceMin', c.price_min,
               'PriceMax', c.price_max,
               'PropertyObjectsTotalCount', c.property_objects_total_count,
               'PropertyObjectsFreeCount', c.property_objects_free_count)
    FROM changed c
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: delete_request(project_id)!
-- Closes the debounce window in the same transaction as the recalc: a request that arrives
-- from now on waits for this commit and then inserts a fresh row.
DELETE FROM chessboard.project_recalc_requests WHERE project_id = :project_id;

-- name: record_failure(project_id, error)!
-- After the project's work was rolled back (to a savepoint, so the row lock is still held):
-- due_at stays, so the next tick retries; attempt_count reaching poison_attempts parks the row.
UPDATE chessboard.project_recalc_requests
SET attempt_count = attempt_count + 1, last_error = left(:error, 1024), updated_at = now()
WHERE project_id = :project_id;

-- name: poisoned_requests()
-- Rows parked for triage (runbook: fix the data, then requeue).
SELECT r.project_id, r.tenant_id, r.attempt_count, r.last_error, r.last_reason,
       r.first_requested_at, r.updated_at
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.attempt_count >= s.poison_attempts
ORDER BY r.updated_at;

-- name: next_due_in_seconds()$
-- Seconds until the next row is ready (<= 0: now; NULL: nothing but poison is queued).
SELECT extract(epoch FROM min(greatest(
           r.due_at,
           CASE WHEN r.attempt_count > 0 THEN r.updated_at + s.retry_interval END)) - now())::float8
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.attempt_count < s.poison_attempts;

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
    SET attempt_count = 0, last_error = NULL, due_at = now(), updated_at = now()
    WHERE project_id = :project_id
    RETURNING 1
)
SELECT count(*) FROM requeued;

-- name: count_poisoned()$
SELECT count(*)
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.attempt_count >= s.poison_attempts;
