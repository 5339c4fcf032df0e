-- The drain's protocol (spec 000, "Алгоритм"), as the drain runs it: a tick is one CALL of
-- recalc_tick (queries/recalc.sql), after settle_abandoned_claims (queries/recalc.sql). The queue
-- protocol these functions implement is model-checked: model/recalc_queue.pml names each of
-- them at the step it stands for.
--
--   claim_due_request      a ready row claimed (claimed_at, attempted_at); nothing counted
--   recalc_claimed_project the work: the claimed row locked again, the savepoint, the project's
--                          rows locked, the recompute, the publication, the request deleted
--   recalc_project_step    a project's work transaction: the work, its outcome recorded
--                          (release_claim, the failed run, the counters)
--   end_claim              recalc_tick's handlers' end of an attempt (the claim given back, or
--                          the statement timeout's failed run), with a lock wait of its own; a
--                          row a writer holds past it gets its end in recalc_pending_claim_ends,
--                          which the next tick's settle writes
--   recalc_tick            a tick's projects in one CALL, a COMMIT per project: each next
--                          claim commits with the previous project's work
--
-- Lock order inside a project's work transaction, always the same so drains cannot deadlock each
-- other: queue row, project row, buildings, layouts, layout groups (all locked before any
-- recompute writes); the next project's queue row is claimed last, with SKIP LOCKED, which never
-- waits.
--
-- The functions are plpgsql, not sql: a sql function that is not inlined parses and plans its
-- body at every call, a plpgsql one plans each statement once per session.

-- One ready row (chessboard.recalc_request_ready, queue.sql) not tried by this tick
-- (p_attempted: a failed or deferred row waits for the next tick), oldest due_at first, SKIP
-- LOCKED (a row another drain works on, or a raiser waits for, is passed over: N drains share
-- the queue and never work on one project at once), stamped claimed_at (the attempt in
-- progress) and attempted_at (the retry clock). Its caller commits it before
-- the work starts, so a drain that dies inside the work leaves a claim that
-- settle_abandoned_claims counts as the failed run it was.
CREATE FUNCTION chessboard.claim_due_request(p_attempted uuid[])
RETURNS TABLE (
    project_id uuid, tenant_id uuid, last_reason text, requested_count int, attempt_count int,
    waited_seconds float8, claimed_at timestamptz, previous_attempted_at timestamptz
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH ready AS (
        SELECT r.project_id, r.attempted_at
        FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
        WHERE chessboard.recalc_request_ready(r, s)
          AND r.project_id <> ALL (coalesce(p_attempted, '{}'))
        ORDER BY r.due_at
        LIMIT 1
        FOR UPDATE OF r SKIP LOCKED
    )
    UPDATE chessboard.project_recalc_requests r
    SET claimed_at = now(), attempted_at = now()
    FROM ready
    WHERE r.project_id = ready.project_id
    RETURNING r.project_id, r.tenant_id, r.last_reason::text, r.requested_count, r.attempt_count,
              extract(epoch FROM now() - r.first_requested_at)::float8,
              r.claimed_at, ready.attempted_at;
END
$$;

-- An attempt that ended without a verdict on the project is given back: no attempt in
-- progress, the retry clock as before the claim. Matching on claimed_at: a claim settled as
-- abandoned (or a row requeued by hand) is not this claim any more, and is left alone.
CREATE FUNCTION chessboard.release_claim(
    p_project_id uuid, p_claimed_at timestamptz, p_previous_attempted_at timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE chessboard.project_recalc_requests r
    SET claimed_at = NULL, attempted_at = p_previous_attempted_at
    WHERE r.project_id = p_project_id AND r.claimed_at = p_claimed_at;
END
$$;

-- The end of an attempt that recalc_tick's handlers could not write to its queue row: a writer
-- (a raiser's upsert, whose transaction may last as long as the edit's) held the row past the
-- handler's lock wait. The handler never waits for it without a bound (the call would outlast
-- its statement timeout and fail, or hold its tick past 30 s), and the claim must not be left
-- to look abandoned (settle_abandoned_claims would count a failed run for contention or a
-- stop). So the end is written here, and the next tick's settle applies it to the row once the
-- row is free (queries/recalc.sql:settle_abandoned_claims), never counting such a claim as
-- abandoned. error NULL: the attempt is given back (release_claim's end, no failed run); else
-- one failed run with this error (record_recalc_timeout's end).
CREATE TABLE chessboard.recalc_pending_claim_ends (
    project_id uuid NOT NULL,
    claimed_at timestamptz NOT NULL,
    previous_attempted_at timestamptz,
    error varchar(1024),
    PRIMARY KEY (project_id, claimed_at)
);

-- How recalc_tick's handlers end an attempt whose work was rolled back: the claim given back
-- (p_error NULL) or one failed run with p_error, written to the row if its lock comes within
-- p_lock_wait (at least a millisecond: lock_timeout 0 would wait without end), else left in
-- recalc_pending_claim_ends for the next tick's settle. A cancel landing in the wait (a stop's,
-- or the statement timeout's) ends it the same way and is reported (cancelled), so that the
-- caller ends its call. failed_runs: the row's failed runs after a failure; when the failure is
-- left pending, what the settle will make of them (only a settle or a requeue changes the
-- attempt_count of a claimed row, and either ends this claim, the pending end with it).
CREATE FUNCTION chessboard.end_claim(
    p_project_id uuid, p_claimed_at timestamptz, p_previous_attempted_at timestamptz,
    p_error text, p_lock_wait interval, OUT failed_runs int, OUT cancelled boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    cancelled := false;
    BEGIN
        PERFORM set_config('lock_timeout', greatest(1, ceil(
            extract(epoch FROM p_lock_wait) * 1000))::int::text, true);
        IF p_error IS NULL THEN
            PERFORM chessboard.release_claim(p_project_id, p_claimed_at, p_previous_attempted_at);
        ELSE
            UPDATE chessboard.project_recalc_requests r
            SET attempt_count = r.attempt_count + 1, last_error = p_error, claimed_at = NULL,
                updated_at = now()
            WHERE r.project_id = p_project_id AND r.claimed_at = p_claimed_at
            RETURNING r.attempt_count INTO failed_runs;
        END IF;
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
    EXCEPTION
        WHEN lock_not_available OR query_canceled THEN
            cancelled := SQLSTATE = '57014';
            INSERT INTO chessboard.recalc_pending_claim_ends
                (project_id, claimed_at, previous_attempted_at, error)
            VALUES (p_project_id, p_claimed_at, p_previous_attempted_at, p_error);
            IF p_error IS NOT NULL THEN
                SELECT r.attempt_count + 1 INTO failed_runs
                FROM chessboard.project_recalc_requests r
                WHERE r.project_id = p_project_id AND r.claimed_at = p_claimed_at;
            END IF;
    END;
END
$$;

-- A failure is stored as the drain names it: psycopg's exception class for the SQLSTATE
-- (PostgreSQL's condition name in CamelCase, e.g. RaiseException), then the error as libpq
-- prints it. The names are those of psycopg 3.3's errors module (PostgreSQL 15's errcodes.txt),
-- rows at the end of this file; an unknown state reads "SQLSTATE <code>".
CREATE TABLE chessboard.sqlstate_names (
    sqlstate char(5) PRIMARY KEY,
    name text NOT NULL
);

-- One claimed project's work: the statements of spec 000, step 4, and contract section 4 (a row
-- whose snapshot or aggregates moved gets Version + 1 and an event in the same transaction),
-- with the locks that make the queue protocol safe.
--
-- It never raises for the project's own failure: the inner block (a savepoint) rolls the work
-- back, the claimed queue row stays locked by the caller's transaction, and the outcome says what
-- happened, so the caller records it in that same transaction. What it raises is the caller's:
-- lock_not_available on the queue row itself (a raiser's upsert in flight) and a stop's cancel.
--
-- Outcomes: "recalculated" (the counts of written buildings and of published layouts, layout
-- groups and projects), "skipped_archived" (an archived or deleted project: the request is
-- deleted, nothing else is touched), "deferred" (the row is no longer this claim's; or a row of
-- the project was locked past lock_timeout), "failed" (error_state, the SQLSTATE, and
-- error_message, the error as libpq prints it without its severity). requests_served: the
-- row's requested_count when the work locked it (NULL when the claim was gone), every request
-- the work serves: one that landed between the claim's commit and that lock included.
CREATE FUNCTION chessboard.recalc_claimed_project(
    p_project_id uuid, p_claimed_at timestamptz, p_traceparent text, p_lock_share float8
) RETURNS TABLE (
    outcome text, buildings_written int, layouts_published int, layout_groups_published int,
    projects_published int, error_state text, error_message text, requests_served int
)
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_deleted_at timestamptz;
    v_detail text;
    v_hint text;
    v_context text;
    v_topics text[];
    v_ids uuid[];
    v_versions bigint[];
    v_snapshots jsonb[];
BEGIN
    -- lock_timeout: a row lock is waited for p_lock_share of the server's deadlock_timeout, read
    -- from the server so the drain gives up before an edit's deadlock check whatever the server
    -- is configured with (LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT in drain.py). lock_timeout is
    -- read when a wait starts, so it holds for this statement's own waits; statement_timeout is
    -- armed when a statement starts, so the drain sets that one for its session.
    PERFORM set_config('lock_timeout', greatest(1, round(p_lock_share * extract(epoch FROM
        current_setting('deadlock_timeout')::interval) * 1000))::int::text, true);

    -- lock_claimed_request: the claimed row, locked until the caller's COMMIT. Not found: the
    -- row is no longer this claim's (deleted or requeued by hand, or settled as abandoned
    -- because the drain stalled past retry_interval since its claim). Its requested_count is
    -- read here, under the lock: from now on a request waits for the COMMIT and inserts a new
    -- row, so this count is exactly the requests the delete below serves.
    SELECT r.requested_count INTO requests_served
    FROM chessboard.project_recalc_requests r
    WHERE r.project_id = p_project_id AND r.claimed_at = p_claimed_at
    FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'deferred';
        RETURN NEXT;
        RETURN;
    END IF;

    BEGIN  -- the savepoint: a failure rolls back the work and keeps the queue row locked
        -- lock_project: every row this transaction may write, locked at once in the lock
        -- order (project, buildings, layouts, layout groups), so any wait for a row an HTTP
        -- edit holds starts right after the claim, never after the longer recalc statements:
        -- in a lock cycle with an edit whose raiser waits for the claimed queue row, the
        -- drain's lock_timeout (half of deadlock_timeout) runs out before the edit's deadlock
        -- check, so the drain defers and the edit goes through. NO KEY UPDATE is the lock the
        -- UPDATEs below take anyway; unlike FOR UPDATE it lets the API insert rows that
        -- reference these (a foreign key takes KEY SHARE) without waiting.
        SELECT p.status, p.deleted_at INTO v_status, v_deleted_at
        FROM chessboard.projects p WHERE p.id = p_project_id
        FOR NO KEY UPDATE;
        IF NOT FOUND OR v_status = 'Archived' OR v_deleted_at IS NOT NULL THEN
            -- An archived or deleted project carries no aggregates: close the window only.
            DELETE FROM chessboard.project_recalc_requests r WHERE r.project_id = p_project_id;
            outcome := 'skipped_archived';
            RETURN NEXT;
            RETURN;
        END IF;
        PERFORM 1 FROM chessboard.buildings b WHERE b.project_id = p_project_id
        ORDER BY b.id FOR NO KEY UPDATE;
        PERFORM 1 FROM chessboard.layouts l WHERE l.project_id = p_project_id
        ORDER BY l.id FOR NO KEY UPDATE;
        PERFORM 1 FROM chessboard.layout_groups g WHERE g.project_id = p_project_id
        ORDER BY g.id FOR NO KEY UPDATE;

        -- The four aggregate tables in ONE statement: every statement has its own executor
        -- start. The CTEs read one snapshot, and none reads what another writes: the drain
        -- writes only derived columns, and the group and project aggregates read the layouts'
        -- and objects' source columns. The changed rows come back as arrays, and the outbox
        -- INSERT below takes the three entities' events, only when there are any (an INSERT
        -- into outbox_events prepares its generated columns at its start, rows or not).
        --
        -- Building counters are written but never published: they are not in the building
        -- event's payload. The three published entities share one rule (contract section 4): a
        -- row whose snapshot (its entity fields with the recomputed aggregates) differs from
        -- the one it last published, or whose aggregate columns differ from the truth, gets
        -- Version + 1 and an event in the same transaction; any other row is left untouched, so
        -- a duplicate run writes nothing. The snapshot covers the row's own fields too: a
        -- renamed, re-sorted or archived group, a renamed project and a new row
        -- (published_snapshot NULL) are published although no aggregate moved. p_traceparent:
        -- the project span's W3C context, carried with its events (NULL: not traced).
        WITH building_truth AS (
            SELECT b.id,
                   count(po.id) FILTER (WHERE po.status <> 'Hidden') AS total,
                   count(po.id) FILTER (WHERE po.status = 'Free') AS free
            FROM chessboard.buildings b
            LEFT JOIN chessboard.property_objects po
                   ON po.building_id = b.id AND po.project_id = b.project_id
                  AND po.deleted_at IS NULL
            WHERE b.project_id = p_project_id
            GROUP BY b.id
        ), buildings_changed AS (
            UPDATE chessboard.buildings b
            SET property_objects_total_count = t.total, property_objects_free_count = t.free,
                version = b.version + 1, updated_at = now()
            FROM building_truth t
            WHERE b.id = t.id
              AND (b.property_objects_total_count, b.property_objects_free_count)
                  IS DISTINCT FROM (t.total, t.free)
            RETURNING 1
        -- Active objects per layout.
        ), layout_truth AS (
            SELECT l.id, count(po.id)::int AS objects
            FROM chessboard.layouts l
            LEFT JOIN chessboard.property_objects po
                   ON po.layout_id = l.id AND po.project_id = l.project_id
                  AND po.deleted_at IS NULL AND po.status <> 'Hidden'
            WHERE l.project_id = p_project_id
            GROUP BY l.id
        ), layout_fresh AS (
            SELECT l.id, t.objects, chessboard.layout_snapshot(l, t.objects) AS snapshot
            FROM chessboard.layouts l JOIN layout_truth t ON t.id = l.id
        ), layouts_changed AS (
            UPDATE chessboard.layouts l
            SET property_objects_count = f.objects, published_snapshot = f.snapshot,
                version = l.version + 1, updated_at = now()
            FROM layout_fresh f
            WHERE l.id = f.id
              AND (l.property_objects_count IS DISTINCT FROM f.objects
                   OR l.published_snapshot IS DISTINCT FROM f.snapshot)
            RETURNING 'pin.chessboard.layout-upserted.v1' AS topic, l.id, l.version,
                      l.published_snapshot
        -- Live layouts per group and their area bounds.
        ), group_truth AS (
            SELECT g.id, count(l.id)::int AS layouts,
                   min(l.total_area) AS area_min, max(l.total_area) AS area_max
            FROM chessboard.layout_groups g
            LEFT JOIN chessboard.layouts l
                   ON l.layout_group_id = g.id AND l.project_id = g.project_id
                  AND l.deleted_at IS NULL
            WHERE g.project_id = p_project_id
            GROUP BY g.id
        ), group_fresh AS (
            SELECT g.id, t.layouts, t.area_min, t.area_max,
                   chessboard.layout_group_snapshot(g, t.layouts, t.area_min, t.area_max)
                       AS snapshot
            FROM chessboard.layout_groups g JOIN group_truth t ON t.id = g.id
        ), groups_changed AS (
            UPDATE chessboard.layout_groups g
            SET layouts_count = f.layouts, area_min = f.area_min, area_max = f.area_max,
                published_snapshot = f.snapshot, version = g.version + 1, updated_at = now()
            FROM group_fresh f
            WHERE g.id = f.id
              AND ((g.layouts_count, g.area_min, g.area_max)
                       IS DISTINCT FROM (f.layouts, f.area_min, f.area_max)
                   OR g.published_snapshot IS DISTINCT FROM f.snapshot)
            RETURNING 'pin.chessboard.layout-group-upserted.v1' AS topic, g.id, g.version,
                      g.published_snapshot
        -- Free-object price bounds and counters of the project.
        ), project_truth AS (
            SELECT (count(*) FILTER (WHERE po.status <> 'Hidden'))::int AS total,
                   (count(*) FILTER (WHERE po.status = 'Free'))::int AS free,
                   min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
                   max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
            FROM chessboard.property_objects po
            WHERE po.project_id = p_project_id AND po.deleted_at IS NULL
        ), project_fresh AS (
            SELECT p.id, t.total, t.free, t.price_min, t.price_max,
                   chessboard.project_snapshot(p, t.total, t.free, t.price_min, t.price_max)
                       AS snapshot
            FROM chessboard.projects p, project_truth t
            WHERE p.id = p_project_id
        ), projects_changed AS (
            UPDATE chessboard.projects p
            SET property_objects_total_count = f.total, property_objects_free_count = f.free,
                price_min = f.price_min, price_max = f.price_max,
                published_snapshot = f.snapshot, version = p.version + 1, updated_at = now()
            FROM project_fresh f
            WHERE p.id = f.id
              AND ((p.property_objects_total_count, p.property_objects_free_count,
                    p.price_min, p.price_max)
                       IS DISTINCT FROM (f.total, f.free, f.price_min, f.price_max)
                   OR p.published_snapshot IS DISTINCT FROM f.snapshot)
            RETURNING 'pin.chessboard.project-upserted.v1' AS topic, p.id, p.version,
                      p.published_snapshot
        )
        SELECT (SELECT count(*) FROM buildings_changed),
               count(*) FILTER (WHERE c.topic = 'pin.chessboard.layout-upserted.v1'),
               count(*) FILTER (WHERE c.topic = 'pin.chessboard.layout-group-upserted.v1'),
               count(*) FILTER (WHERE c.topic = 'pin.chessboard.project-upserted.v1'),
               array_agg(c.topic), array_agg(c.id), array_agg(c.version),
               array_agg(c.published_snapshot)
        INTO buildings_written, layouts_published, layout_groups_published, projects_published,
             v_topics, v_ids, v_versions, v_snapshots
        FROM (SELECT * FROM layouts_changed
              UNION ALL SELECT * FROM groups_changed
              UNION ALL SELECT * FROM projects_changed) c;

        -- publish_changed: the events of the rows changed above, in that order (layouts,
        -- groups, project), with the envelope made now (EventId, CreatedAt).
        IF v_topics IS NOT NULL THEN
            INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
            SELECT u.topic, u.id::text,
                   chessboard.event_envelope(u.id, u.version) || u.snapshot, p_traceparent
            FROM unnest(v_topics, v_ids, v_versions, v_snapshots)
                AS u(topic, id, version, snapshot);
        ELSE
            -- relaxed_commit: nothing to publish, so this transaction's commit does not wait
            -- for the WAL flush. Only a server crash within a fraction of a second can forget
            -- such a commit, and what it forgets is a recompute that published nothing: the
            -- queue row is back, its claim is settled as abandoned, the project is recomputed.
            -- A transaction that wrote events waits for the flush: the relay may send them as
            -- soon as it commits, so a crash must not take them back.
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;

        -- delete_request: closes the debounce window in the recalc's transaction; a request
        -- that arrives from now on waits for the COMMIT and then inserts a fresh row.
        DELETE FROM chessboard.project_recalc_requests r WHERE r.project_id = p_project_id;
    EXCEPTION
        WHEN lock_not_available THEN
            -- A row an edit holds: contention, not a poison (the caller gives the claim back).
            outcome := 'deferred';
            buildings_written := NULL; layouts_published := NULL;
            layout_groups_published := NULL; projects_published := NULL;
            RETURN NEXT;
            RETURN;
        WHEN query_canceled OR OTHERS THEN
            -- A stuck project's statement_timeout is its failure; a stop's cancel shares the
            -- SQLSTATE and is the caller's (it gives the attempt back): raised on.
            IF SQLSTATE = '57014' AND SQLERRM NOT LIKE '%statement timeout%' THEN
                RAISE;
            END IF;
            GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT,
                                    v_context = PG_EXCEPTION_CONTEXT;
            outcome := 'failed';
            buildings_written := NULL; layouts_published := NULL;
            layout_groups_published := NULL; projects_published := NULL;
            error_state := SQLSTATE;
            error_message := SQLERRM
                || coalesce(E'\nDETAIL:  ' || nullif(v_detail, ''), '')
                || coalesce(E'\nHINT:  ' || nullif(v_hint, ''), '')
                || coalesce(E'\nCONTEXT:  ' || nullif(v_context, ''), '');
            RETURN NEXT;
            RETURN;
    END;
    outcome := 'recalculated';
    RETURN NEXT;
END
$$;

-- One claimed project's work transaction. The work is recalc_claimed_project; then, while the
-- claimed row is still held, its outcome is recorded (release_claim for "deferred", one more
-- failed run for "failed", the outcome row for the counters); then, when p_claim_next, the next
-- ready project other than p_attempted and this one is claimed (the next_* columns; NULL when
-- none; recalc_tick passes false and claims the next project itself, in the same block). What
-- recalc_claimed_project raises (lock_not_available on the claimed row, a cancel) rolls the
-- whole step back, the next claim included: recalc_tick's handlers take over.
-- duration_seconds: the work, from the step's start to its outcome recorded (the histogram's
-- observation; NULL in the histogram for "deferred", whose time is lock waiting).
-- requests_served: the requests a done project ("recalculated", "skipped_archived") served, as
-- recalc_claimed_project counted them under its lock (chessboard_recalc_coalesced_events_total).
-- p_requested_count, the claim's count, is no longer read (a request may land between the claim
-- and the lock): it stays in the signature for the previous release's recalc_tick, which calls
-- this function until its call in hand ends; the next migration that changes it drops it.
CREATE FUNCTION chessboard.recalc_project_step(
    p_project_id uuid, p_claimed_at timestamptz, p_previous_attempted_at timestamptz,
    p_requested_count int, p_traceparent text, p_lock_share float8, p_claim_next boolean,
    p_attempted uuid[]
) RETURNS TABLE (
    outcome text, duration_seconds float8, buildings_written int, layouts_published int,
    layout_groups_published int, projects_published int, error text, attempt_count int,
    next_project_id uuid, next_tenant_id uuid, next_last_reason text, next_requested_count int,
    next_attempt_count int, next_waited_seconds float8, next_claimed_at timestamptz,
    next_previous_attempted_at timestamptz, requests_served int
)
LANGUAGE plpgsql AS $$
DECLARE
    v_started timestamptz := clock_timestamp();
    v_work record;
    v_next record;
BEGIN
    -- The raisers skip the work's own writes (pin.recalc_write, below); set back after it (what
    -- recalc_claimed_project raises ends the transaction, and the setting with it).
    PERFORM set_config('pin.recalc_write', 'on', true);
    SELECT * INTO v_work
    FROM chessboard.recalc_claimed_project(p_project_id, p_claimed_at, p_traceparent,
                                           p_lock_share);
    PERFORM set_config('pin.recalc_write', 'off', true);
    outcome := v_work.outcome;
    buildings_written := v_work.buildings_written;
    layouts_published := v_work.layouts_published;
    layout_groups_published := v_work.layout_groups_published;
    projects_published := v_work.projects_published;
    IF outcome IN ('recalculated', 'skipped_archived') THEN
        requests_served := v_work.requests_served;
    END IF;

    IF outcome = 'deferred' THEN
        -- A row lock held elsewhere (contention is not a poison): the attempt is given back. Or
        -- the claim is no longer this drain's: release_claim then changes nothing.
        PERFORM chessboard.release_claim(p_project_id, p_claimed_at, p_previous_attempted_at);
    ELSIF outcome = 'failed' THEN
        -- record_failure: the work was rolled back to its savepoint, the claimed row is still
        -- locked: one more failed run, its error, no attempt in progress. due_at stays, so a
        -- later tick retries, and attempt_count at poison_attempts parks the row.
        error := left(btrim(
            coalesce((SELECT n.name FROM chessboard.sqlstate_names n
                      WHERE n.sqlstate = v_work.error_state),
                     'SQLSTATE ' || v_work.error_state)
            || ': ' || coalesce(v_work.error_message, ''), E' \t\n\r\f\v'), 1024);
        UPDATE chessboard.project_recalc_requests r
        SET attempt_count = r.attempt_count + 1, last_error = error, claimed_at = NULL,
            updated_at = now()
        WHERE r.project_id = p_project_id
        RETURNING r.attempt_count INTO attempt_count;
    END IF;
    duration_seconds := extract(epoch FROM clock_timestamp() - v_started);

    PERFORM chessboard.record_recalc_outcome(
        CASE outcome WHEN 'recalculated' THEN 'success' WHEN 'failed' THEN 'error'
                     ELSE outcome END,
        CASE WHEN outcome = 'deferred' THEN NULL ELSE duration_seconds END,
        coalesce(requests_served, 0),
        coalesce(projects_published, 0), coalesce(layouts_published, 0),
        coalesce(layout_groups_published, 0));

    IF p_claim_next THEN
        SELECT * INTO v_next
        FROM chessboard.claim_due_request(array_append(p_attempted, p_project_id));
        next_project_id := v_next.project_id;
        next_tenant_id := v_next.tenant_id;
        next_last_reason := v_next.last_reason;
        next_requested_count := v_next.requested_count;
        next_attempt_count := v_next.attempt_count;
        next_waited_seconds := v_next.waited_seconds;
        next_claimed_at := v_next.claimed_at;
        next_previous_attempted_at := v_next.previous_attempted_at;
    END IF;
    RETURN NEXT;
END
$$;

-- A project whose work the statement timeout cancelled: one more failed run with the error, no
-- attempt in progress, and its outcome counted, as recalc_project_step records a failure (the
-- work was rolled back with recalc_tick's block, its lock on the claimed row with it). The call
-- is past its statement timeout, which does not fire again: the row is not waited for (a writer
-- whose upsert waited for the work holds it now), the failed run is then left to the next
-- tick's settle (end_claim). Returns the project's report for recalc_tick's results.
CREATE FUNCTION chessboard.record_recalc_timeout(
    p_project_id uuid, p_claimed_at timestamptz, p_state text, p_message text,
    p_duration interval
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_error text := left(
        coalesce((SELECT n.name FROM chessboard.sqlstate_names n WHERE n.sqlstate = p_state),
                 'SQLSTATE ' || p_state) || ': ' || p_message, 1024);
    v_end record;
    v_seconds float8 := extract(epoch FROM p_duration);
BEGIN
    v_end := chessboard.end_claim(p_project_id, p_claimed_at, NULL, v_error, interval '0');
    PERFORM chessboard.record_recalc_outcome('error', v_seconds, 0, 0, 0, 0);
    RETURN jsonb_build_object('outcome', 'failed', 'duration_seconds', v_seconds,
                              'error', v_error, 'failed_runs', v_end.failed_runs,
                              'timed_out', true);
END
$$;

-- A drain tick in one CALL, a COMMIT per project: one round trip per tick instead of one per
-- project, the drain's Python woken once. Each project still runs recalc_project_step in a
-- transaction of its own: the tick's first claim commits alone before any work (an attempt in
-- progress is visible, and a drain that dies inside the work leaves it to
-- settle_abandoned_claims); each next claim commits with the previous project's work; SKIP
-- LOCKED between drains. What the procedure adds:
--
-- * A claiming window: no next project is claimed once p_claim_for has passed since the call
--   started, so the drain still obeys a stop (and its tick budget) between calls; the call lasts
--   at most the window plus the last project. The drain's statement_timeout is therefore the
--   per-project bound plus that window (drain.py).
-- * Each project's work and the next claim run in a block of their own (a subtransaction):
--   - lock_not_available on the claimed row itself (a raiser's upsert of it in flight since the
--     claim's commit) defers that project with its attempt given back, and the tick goes on;
--   - a cancel ends the call normally, the project in hand rolled back whole and reported with
--     the projects already committed: a stop's cancel (the drain's, after its grace) gives its
--     attempt back ("interrupted": a deploy never counts towards poison); the statement
--     timeout's (the call has run past it: the project is stuck) counts a failed run with its
--     error (record_recalc_timeout), so a project that always hangs is poisoned after
--     poison_attempts runs. The two are told apart by the call's age, not the message, which
--     the server's locale translates.
-- * The handlers' own waits are bounded (the block's rollback took the work's lock_timeout with
--   it, and the drain's session sets none): each ends its attempt with end_claim, which waits
--   for the claimed row at most: after lock_not_available, until a second before the call's
--   statement timeout (the lock share of deadlock_timeout without one), so the give-back is
--   written at once when the writer is quick and the call never fails on it; after a cancel,
--   not at all (the call is being stopped, or is past its timeout, which does not fire twice).
--   A writer holding the row longer leaves the end to the next tick's settle: no failed run
--   for contention or a stop, no call past its bound, no drain run failed.
--   A cancel landing outside the blocks (between a COMMIT and the next block: a few expressions)
--   still ends the call with the error, as does any other error (the work's own errors are a
--   "failed" outcome inside recalc_project_step; what is left is the server's trouble, e.g. a
--   full disk): the projects committed in the call are then not reported (their work and
--   counters are kept), and a claim in hand is settled as abandoned at the next tick.
--
-- `results`: one JSON object per project, in order: the claim (project_id, tenant_id,
-- last_reason, requested_count, attempt_count: failed runs before this attempt, waited_seconds)
-- and what became of it (outcome, started: epoch seconds, duration_seconds, buildings_written,
-- layouts_published, layout_groups_published, projects_published, error, failed_runs,
-- requests_served).
-- p_traceparents[n] is the n-th project's span, chosen by the drain before the call (the events
-- carry it); NULL when nothing is traced.
CREATE PROCEDURE chessboard.recalc_tick(
    p_batch int, p_claim_for interval, p_attempted uuid[], p_traceparents text[],
    p_lock_share float8, INOUT results jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_claim_until timestamptz := clock_timestamp() + p_claim_for;
    v_timeout interval := nullif(current_setting('statement_timeout'), '0')::interval;
    v_lock_wait interval := make_interval(secs => p_lock_share * extract(epoch FROM
        current_setting('deadlock_timeout')::interval));
    v_end record;
    v_attempted uuid[] := coalesce(p_attempted, '{}');
    v_started timestamptz;
    v_claim record;
    v_next record;
    v_step record;
    v_report jsonb;
    v_claimed_next boolean;
    n int := 0;
BEGIN
    results := '[]';
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT * INTO v_claim FROM chessboard.claim_due_request(v_attempted);
    COMMIT;
    WHILE v_claim.project_id IS NOT NULL LOOP
        n := n + 1;
        v_started := clock_timestamp();
        v_claimed_next := false;
        v_report := NULL;
        BEGIN
            SELECT * INTO v_step FROM chessboard.recalc_project_step(
                v_claim.project_id, v_claim.claimed_at, v_claim.previous_attempted_at,
                v_claim.requested_count, p_traceparents[n], p_lock_share, false, NULL);
            IF v_step.outcome IN ('failed', 'deferred') THEN
                v_attempted := v_attempted || v_claim.project_id;
            END IF;
            IF n < p_batch AND clock_timestamp() < v_claim_until THEN
                SELECT * INTO v_next
                FROM chessboard.claim_due_request(v_attempted || v_claim.project_id);
                v_claimed_next := true;
            END IF;
            v_report := jsonb_build_object(
                'outcome', v_step.outcome, 'duration_seconds', v_step.duration_seconds,
                'buildings_written', v_step.buildings_written,
                'layouts_published', v_step.layouts_published,
                'layout_groups_published', v_step.layout_groups_published,
                'projects_published', v_step.projects_published,
                'error', v_step.error, 'failed_runs', v_step.attempt_count,
                'requests_served', v_step.requests_served);
        EXCEPTION
            WHEN lock_not_available THEN
                -- A second before the statement timeout: room for the end's record and the
                -- call's return (drain.py cancels a stopping call as long before it).
                v_end := chessboard.end_claim(
                    v_claim.project_id, v_claim.claimed_at, v_claim.previous_attempted_at, NULL,
                    coalesce(v_timeout - (clock_timestamp() - statement_timestamp())
                             - interval '1 second', v_lock_wait));
                PERFORM chessboard.record_recalc_outcome('deferred', NULL, 0, 0, 0, 0);
                v_attempted := v_attempted || v_claim.project_id;
                v_report := jsonb_build_object('outcome', 'deferred');
                -- A cancel in the give-back's wait ends the call: no next claim.
                IF NOT v_end.cancelled AND n < p_batch AND clock_timestamp() < v_claim_until THEN
                    SELECT * INTO v_next FROM chessboard.claim_due_request(v_attempted);
                    v_claimed_next := true;
                END IF;
            WHEN query_canceled THEN
                -- The statement timeout's, when the call is within half a second of it:
                -- statement_timestamp() is the Execute message's, a little after the timeout was
                -- armed (at the Parse), and a stop's cancel comes a second before it at the
                -- latest (drain.py's CANCEL_BEFORE_TIMEOUT_SECONDS).
                IF clock_timestamp() - statement_timestamp() >= v_timeout - interval '0.5 s' THEN
                    v_report := chessboard.record_recalc_timeout(
                        v_claim.project_id, v_claim.claimed_at, SQLSTATE, SQLERRM,
                        clock_timestamp() - v_started);
                ELSE
                    PERFORM chessboard.end_claim(v_claim.project_id, v_claim.claimed_at,
                                                 v_claim.previous_attempted_at, NULL,
                                                 interval '0');
                    v_report := jsonb_build_object('outcome', 'interrupted');
                END IF;
        END;
        results := results || jsonb_build_array(
            jsonb_build_object('duration_seconds',
                               extract(epoch FROM clock_timestamp() - v_started))
            || v_report || jsonb_build_object(
            'project_id', v_claim.project_id, 'tenant_id', v_claim.tenant_id,
            'last_reason', v_claim.last_reason, 'requested_count', v_claim.requested_count,
            'attempt_count', v_claim.attempt_count, 'waited_seconds', v_claim.waited_seconds,
            'started', extract(epoch FROM v_started)));
        -- After a cancel the call ends (the statement timeout has fired: nothing would bound
        -- what came next); and with no next claim.
        EXIT WHEN NOT v_claimed_next OR v_report->>'outcome' = 'interrupted'
                  OR v_report ? 'timed_out';
        v_claim := v_next;
        COMMIT;
    END LOOP;
END
$$;

INSERT INTO chessboard.sqlstate_names (sqlstate, name) VALUES
    ('02000', 'NoData'),
    ('02001', 'NoAdditionalDynamicResultSetsReturned'),
    ('03000', 'SqlStatementNotYetComplete'),
    ('08000', 'ConnectionException'),
    ('08001', 'SqlclientUnableToEstablishSqlconnection'),
    ('08003', 'ConnectionDoesNotExist'),
    ('08004', 'SqlserverRejectedEstablishmentOfSqlconnection'),
    ('08006', 'ConnectionFailure'),
    ('08007', 'TransactionResolutionUnknown'),
    ('08P01', 'ProtocolViolation'),
    ('09000', 'TriggeredActionException'),
    ('0A000', 'FeatureNotSupported'),
    ('0B000', 'InvalidTransactionInitiation'),
    ('0F000', 'LocatorException'),
    ('0F001', 'InvalidLocatorSpecification'),
    ('0L000', 'InvalidGrantor'),
    ('0LP01', 'InvalidGrantOperation'),
    ('0P000', 'InvalidRoleSpecification'),
    ('0Z000', 'DiagnosticsException'),
    ('0Z002', 'StackedDiagnosticsAccessedWithoutActiveHandler'),
    ('10608', 'InvalidArgumentForXquery'),
    ('20000', 'CaseNotFound'),
    ('21000', 'CardinalityViolation'),
    ('22000', 'DataException'),
    ('22001', 'StringDataRightTruncation'),
    ('22002', 'NullValueNoIndicatorParameter'),
    ('22003', 'NumericValueOutOfRange'),
    ('22004', 'NullValueNotAllowed'),
    ('22005', 'ErrorInAssignment'),
    ('22007', 'InvalidDatetimeFormat'),
    ('22008', 'DatetimeFieldOverflow'),
    ('22009', 'InvalidTimeZoneDisplacementValue'),
    ('2200B', 'EscapeCharacterConflict'),
    ('2200C', 'InvalidUseOfEscapeCharacter'),
    ('2200D', 'InvalidEscapeOctet'),
    ('2200F', 'ZeroLengthCharacterString'),
    ('2200G', 'MostSpecificTypeMismatch'),
    ('2200H', 'SequenceGeneratorLimitExceeded'),
    ('2200L', 'NotAnXmlDocument'),
    ('2200M', 'InvalidXmlDocument'),
    ('2200N', 'InvalidXmlContent'),
    ('2200S', 'InvalidXmlComment'),
    ('2200T', 'InvalidXmlProcessingInstruction'),
    ('22010', 'InvalidIndicatorParameterValue'),
    ('22011', 'SubstringError'),
    ('22012', 'DivisionByZero'),
    ('22013', 'InvalidPrecedingOrFollowingSize'),
    ('22014', 'InvalidArgumentForNtileFunction'),
    ('22015', 'IntervalFieldOverflow'),
    ('22016', 'InvalidArgumentForNthValueFunction'),
    ('22018', 'InvalidCharacterValueForCast'),
    ('22019', 'InvalidEscapeCharacter'),
    ('2201B', 'InvalidRegularExpression'),
    ('2201E', 'InvalidArgumentForLogarithm'),
    ('2201F', 'InvalidArgumentForPowerFunction'),
    ('2201G', 'InvalidArgumentForWidthBucketFunction'),
    ('2201W', 'InvalidRowCountInLimitClause'),
    ('2201X', 'InvalidRowCountInResultOffsetClause'),
    ('22021', 'CharacterNotInRepertoire'),
    ('22022', 'IndicatorOverflow'),
    ('22023', 'InvalidParameterValue'),
    ('22024', 'UnterminatedCString'),
    ('22025', 'InvalidEscapeSequence'),
    ('22026', 'StringDataLengthMismatch'),
    ('22027', 'TrimError'),
    ('2202E', 'ArraySubscriptError'),
    ('2202G', 'InvalidTablesampleRepeat'),
    ('2202H', 'InvalidTablesampleArgument'),
    ('22030', 'DuplicateJsonObjectKeyValue'),
    ('22031', 'InvalidArgumentForSqlJsonDatetimeFunction'),
    ('22032', 'InvalidJsonText'),
    ('22033', 'InvalidSqlJsonSubscript'),
    ('22034', 'MoreThanOneSqlJsonItem'),
    ('22035', 'NoSqlJsonItem'),
    ('22036', 'NonNumericSqlJsonItem'),
    ('22037', 'NonUniqueKeysInAJsonObject'),
    ('22038', 'SingletonSqlJsonItemRequired'),
    ('22039', 'SqlJsonArrayNotFound'),
    ('2203A', 'SqlJsonMemberNotFound'),
    ('2203B', 'SqlJsonNumberNotFound'),
    ('2203C', 'SqlJsonObjectNotFound'),
    ('2203D', 'TooManyJsonArrayElements'),
    ('2203E', 'TooManyJsonObjectMembers'),
    ('2203F', 'SqlJsonScalarRequired'),
    ('2203G', 'SqlJsonItemCannotBeCastToTargetType'),
    ('22P01', 'FloatingPointException'),
    ('22P02', 'InvalidTextRepresentation'),
    ('22P03', 'InvalidBinaryRepresentation'),
    ('22P04', 'BadCopyFileFormat'),
    ('22P05', 'UntranslatableCharacter'),
    ('22P06', 'NonstandardUseOfEscapeCharacter'),
    ('23000', 'IntegrityConstraintViolation'),
    ('23001', 'RestrictViolation'),
    ('23502', 'NotNullViolation'),
    ('23503', 'ForeignKeyViolation'),
    ('23505', 'UniqueViolation'),
    ('23514', 'CheckViolation'),
    ('23P01', 'ExclusionViolation'),
    ('24000', 'InvalidCursorState'),
    ('25000', 'InvalidTransactionState'),
    ('25001', 'ActiveSqlTransaction'),
    ('25002', 'BranchTransactionAlreadyActive'),
    ('25003', 'InappropriateAccessModeForBranchTransaction'),
    ('25004', 'InappropriateIsolationLevelForBranchTransaction'),
    ('25005', 'NoActiveSqlTransactionForBranchTransaction'),
    ('25006', 'ReadOnlySqlTransaction'),
    ('25007', 'SchemaAndDataStatementMixingNotSupported'),
    ('25008', 'HeldCursorRequiresSameIsolationLevel'),
    ('25P01', 'NoActiveSqlTransaction'),
    ('25P02', 'InFailedSqlTransaction'),
    ('25P03', 'IdleInTransactionSessionTimeout'),
    ('25P04', 'TransactionTimeout'),
    ('26000', 'InvalidSqlStatementName'),
    ('27000', 'TriggeredDataChangeViolation'),
    ('28000', 'InvalidAuthorizationSpecification'),
    ('28P01', 'InvalidPassword'),
    ('2B000', 'DependentPrivilegeDescriptorsStillExist'),
    ('2BP01', 'DependentObjectsStillExist'),
    ('2D000', 'InvalidTransactionTermination'),
    ('2F000', 'SqlRoutineException'),
    ('2F002', 'ModifyingSqlDataNotPermitted'),
    ('2F003', 'ProhibitedSqlStatementAttempted'),
    ('2F004', 'ReadingSqlDataNotPermitted'),
    ('2F005', 'FunctionExecutedNoReturnStatement'),
    ('34000', 'InvalidCursorName'),
    ('38000', 'ExternalRoutineException'),
    ('38001', 'ContainingSqlNotPermitted'),
    ('38002', 'ModifyingSqlDataNotPermittedExt'),
    ('38003', 'ProhibitedSqlStatementAttemptedExt'),
    ('38004', 'ReadingSqlDataNotPermittedExt'),
    ('39000', 'ExternalRoutineInvocationException'),
    ('39001', 'InvalidSqlstateReturned'),
    ('39004', 'NullValueNotAllowedExt'),
    ('39P01', 'TriggerProtocolViolated'),
    ('39P02', 'SrfProtocolViolated'),
    ('39P03', 'EventTriggerProtocolViolated'),
    ('3B000', 'SavepointException'),
    ('3B001', 'InvalidSavepointSpecification'),
    ('3D000', 'InvalidCatalogName'),
    ('3F000', 'InvalidSchemaName'),
    ('40000', 'TransactionRollback'),
    ('40001', 'SerializationFailure'),
    ('40002', 'TransactionIntegrityConstraintViolation'),
    ('40003', 'StatementCompletionUnknown'),
    ('40P01', 'DeadlockDetected'),
    ('42000', 'SyntaxErrorOrAccessRuleViolation'),
    ('42501', 'InsufficientPrivilege'),
    ('42601', 'SyntaxError'),
    ('42602', 'InvalidName'),
    ('42611', 'InvalidColumnDefinition'),
    ('42622', 'NameTooLong'),
    ('42701', 'DuplicateColumn'),
    ('42702', 'AmbiguousColumn'),
    ('42703', 'UndefinedColumn'),
    ('42704', 'UndefinedObject'),
    ('42710', 'DuplicateObject'),
    ('42712', 'DuplicateAlias'),
    ('42723', 'DuplicateFunction'),
    ('42725', 'AmbiguousFunction'),
    ('42803', 'GroupingError'),
    ('42804', 'DatatypeMismatch'),
    ('42809', 'WrongObjectType'),
    ('42830', 'InvalidForeignKey'),
    ('42846', 'CannotCoerce'),
    ('42883', 'UndefinedFunction'),
    ('428C9', 'GeneratedAlways'),
    ('42939', 'ReservedName'),
    ('42P01', 'UndefinedTable'),
    ('42P02', 'UndefinedParameter'),
    ('42P03', 'DuplicateCursor'),
    ('42P04', 'DuplicateDatabase'),
    ('42P05', 'DuplicatePreparedStatement'),
    ('42P06', 'DuplicateSchema'),
    ('42P07', 'DuplicateTable'),
    ('42P08', 'AmbiguousParameter'),
    ('42P09', 'AmbiguousAlias'),
    ('42P10', 'InvalidColumnReference'),
    ('42P11', 'InvalidCursorDefinition'),
    ('42P12', 'InvalidDatabaseDefinition'),
    ('42P13', 'InvalidFunctionDefinition'),
    ('42P14', 'InvalidPreparedStatementDefinition'),
    ('42P15', 'InvalidSchemaDefinition'),
    ('42P16', 'InvalidTableDefinition'),
    ('42P17', 'InvalidObjectDefinition'),
    ('42P18', 'IndeterminateDatatype'),
    ('42P19', 'InvalidRecursion'),
    ('42P20', 'WindowingError'),
    ('42P21', 'CollationMismatch'),
    ('42P22', 'IndeterminateCollation'),
    ('44000', 'WithCheckOptionViolation'),
    ('53000', 'InsufficientResources'),
    ('53100', 'DiskFull'),
    ('53200', 'OutOfMemory'),
    ('53300', 'TooManyConnections'),
    ('53400', 'ConfigurationLimitExceeded'),
    ('54000', 'ProgramLimitExceeded'),
    ('54001', 'StatementTooComplex'),
    ('54011', 'TooManyColumns'),
    ('54023', 'TooManyArguments'),
    ('55000', 'ObjectNotInPrerequisiteState'),
    ('55006', 'ObjectInUse'),
    ('55P02', 'CantChangeRuntimeParam'),
    ('55P03', 'LockNotAvailable'),
    ('55P04', 'UnsafeNewEnumValueUsage'),
    ('57000', 'OperatorIntervention'),
    ('57014', 'QueryCanceled'),
    ('57P01', 'AdminShutdown'),
    ('57P02', 'CrashShutdown'),
    ('57P03', 'CannotConnectNow'),
    ('57P04', 'DatabaseDropped'),
    ('57P05', 'IdleSessionTimeout'),
    ('58000', 'SystemError'),
    ('58030', 'IoError'),
    ('58P01', 'UndefinedFile'),
    ('58P02', 'DuplicateFile'),
    ('58P03', 'FileNameTooLong'),
    ('72000', 'SnapshotTooOld'),
    ('F0000', 'ConfigFileError'),
    ('F0001', 'LockFileExists'),
    ('HV000', 'FdwError'),
    ('HV001', 'FdwOutOfMemory'),
    ('HV002', 'FdwDynamicParameterValueNeeded'),
    ('HV004', 'FdwInvalidDataType'),
    ('HV005', 'FdwColumnNameNotFound'),
    ('HV006', 'FdwInvalidDataTypeDescriptors'),
    ('HV007', 'FdwInvalidColumnName'),
    ('HV008', 'FdwInvalidColumnNumber'),
    ('HV009', 'FdwInvalidUseOfNullPointer'),
    ('HV00A', 'FdwInvalidStringFormat'),
    ('HV00B', 'FdwInvalidHandle'),
    ('HV00C', 'FdwInvalidOptionIndex'),
    ('HV00D', 'FdwInvalidOptionName'),
    ('HV00J', 'FdwOptionNameNotFound'),
    ('HV00K', 'FdwReplyHandle'),
    ('HV00L', 'FdwUnableToCreateExecution'),
    ('HV00M', 'FdwUnableToCreateReply'),
    ('HV00N', 'FdwUnableToEstablishConnection'),
    ('HV00P', 'FdwNoSchemas'),
    ('HV00Q', 'FdwSchemaNotFound'),
    ('HV00R', 'FdwTableNotFound'),
    ('HV010', 'FdwFunctionSequenceError'),
    ('HV014', 'FdwTooManyHandles'),
    ('HV021', 'FdwInconsistentDescriptorInformation'),
    ('HV024', 'FdwInvalidAttributeValue'),
    ('HV090', 'FdwInvalidStringLengthOrBufferLength'),
    ('HV091', 'FdwInvalidDescriptorFieldIdentifier'),
    ('P0000', 'PlpgsqlError'),
    ('P0001', 'RaiseException'),
    ('P0002', 'NoDataFound'),
    ('P0003', 'TooManyRows'),
    ('P0004', 'AssertFailure'),
    ('XX000', 'InternalError_'),
    ('XX001', 'DataCorrupted'),
    ('XX002', 'IndexCorrupted');
