-- depends: 0012_recalc_claimed_at
-- One claimed project's work as one statement. The drain used to send the work
-- transaction's steps one by one (lock_claimed_request, a SAVEPOINT, lock_project, four
-- recalc_* statements, delete_request, RELEASE): eleven round trips per project, most of its
-- cost against a plain per-project function. This function is those steps, in the same order,
-- with the same locks and the same savepoint (its inner block), so the transaction the drain
-- runs and the queue protocol (model/recalc_queue.pml) are unchanged.
--
-- It never raises for the project's own failure: the inner block rolls the work back to its
-- savepoint, the claimed queue row stays locked by the caller's transaction, and the outcome
-- says what happened, so the caller records it in that same transaction (release_claim for
-- "deferred", record_failure for "failed") before COMMIT, as before. What it does raise is left
-- to the caller as before: lock_not_available on the queue row itself (a raiser's upsert in
-- flight: the caller rolls back and gives the claim back) and a stop's cancel.
--
-- Outcomes: "recalculated" (the counts of written buildings and of published layouts, layout
-- groups and projects), "skipped_archived" (an archived or deleted project: the request is
-- deleted, nothing else is touched), "deferred" (the row is no longer this claim's; or a row of
-- the project was locked past lock_timeout), "failed" (error_state, the SQLSTATE, and
-- error_message, the error as libpq prints it without its severity).
--
-- The statements are those of spec 000, step 4, and contract section 4 (a row whose snapshot or
-- aggregates moved gets Version + 1 and an event in the same statement); their comments were in
-- sql/postgres/queries/recalc.sql, which now calls this function (recalc_claimed_project).
CREATE FUNCTION chessboard.recalc_claimed_project(
    p_project_id uuid, p_claimed_at timestamptz, p_traceparent text, p_lock_share float8
) RETURNS TABLE (
    outcome text, buildings_written int, layouts_published int, layout_groups_published int,
    projects_published int, error_state text, error_message text
)
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
    v_deleted_at timestamptz;
    v_detail text;
    v_hint text;
    v_context text;
BEGIN
    -- limit_waits: a row lock is waited for p_lock_share of the server's deadlock_timeout, read
    -- from the server so the drain gives up before an edit's deadlock check whatever the server
    -- is configured with (LOCK_WAIT_SHARE_OF_DEADLOCK_TIMEOUT in drain.py). lock_timeout is
    -- read when a wait starts, so it holds for this statement's own waits; statement_timeout is
    -- armed when a statement starts, so the drain sets that one for its session.
    PERFORM set_config('lock_timeout', greatest(1, round(p_lock_share * extract(epoch FROM
        current_setting('deadlock_timeout')::interval) * 1000))::int::text, true);

    -- lock_claimed_request: the claimed row, locked until the caller's COMMIT. Not found: the
    -- row is no longer this claim's (deleted or requeued by hand, or settled as abandoned
    -- because the drain stalled past retry_interval since its claim).
    PERFORM 1 FROM chessboard.project_recalc_requests r
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

        -- Building counters are written but never published: they are not in the building
        -- event's payload.
        WITH truth AS (
            SELECT b.id,
                   count(po.id) FILTER (WHERE po.status <> 'Hidden') AS total,
                   count(po.id) FILTER (WHERE po.status = 'Free') AS free
            FROM chessboard.buildings b
            LEFT JOIN chessboard.property_objects po
                   ON po.building_id = b.id AND po.project_id = b.project_id
                  AND po.deleted_at IS NULL
            WHERE b.project_id = p_project_id
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
        SELECT count(*) INTO buildings_written FROM changed;

        -- The three published entities share one rule (contract section 4): a row whose
        -- snapshot (its entity fields with the recomputed aggregates) differs from the one it
        -- last published, or whose aggregate columns differ from the truth, gets Version + 1
        -- and an event in the same statement; any other row is left untouched, so a duplicate
        -- run writes nothing. The snapshot covers the row's own fields too: a renamed,
        -- re-sorted or archived group, a renamed project and a new row (published_snapshot
        -- NULL) are published although no aggregate moved. p_traceparent: the project span's
        -- W3C context, carried with its events (NULL: not traced).

        -- Active objects per layout.
        WITH truth AS (
            SELECT l.id, count(po.id)::int AS objects
            FROM chessboard.layouts l
            LEFT JOIN chessboard.property_objects po
                   ON po.layout_id = l.id AND po.project_id = l.project_id
                  AND po.deleted_at IS NULL AND po.status <> 'Hidden'
            WHERE l.project_id = p_project_id
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
                   chessboard.event_envelope(c.id, c.version) || c.published_snapshot,
                   p_traceparent
            FROM changed c
            RETURNING 1
        )
        SELECT count(*) INTO layouts_published FROM published;

        -- Live layouts per group and their area bounds.
        WITH truth AS (
            SELECT g.id, count(l.id)::int AS layouts,
                   min(l.total_area) AS area_min, max(l.total_area) AS area_max
            FROM chessboard.layout_groups g
            LEFT JOIN chessboard.layouts l
                   ON l.layout_group_id = g.id AND l.project_id = g.project_id
                  AND l.deleted_at IS NULL
            WHERE g.project_id = p_project_id
            GROUP BY g.id
        ), fresh AS (
            SELECT g.id, t.layouts, t.area_min, t.area_max,
                   chessboard.layout_group_snapshot(g, t.layouts, t.area_min, t.area_max)
                       AS snapshot
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
                   chessboard.event_envelope(c.id, c.version) || c.published_snapshot,
                   p_traceparent
            FROM changed c
            RETURNING 1
        )
        SELECT count(*) INTO layout_groups_published FROM published;

        -- Free-object price bounds and counters of the project.
        WITH truth AS (
            SELECT (count(*) FILTER (WHERE po.status <> 'Hidden'))::int AS total,
                   (count(*) FILTER (WHERE po.status = 'Free'))::int AS free,
                   min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
                   max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
            FROM chessboard.property_objects po
            WHERE po.project_id = p_project_id AND po.deleted_at IS NULL
        ), fresh AS (
            SELECT p.id, t.total, t.free, t.price_min, t.price_max,
                   chessboard.project_snapshot(p, t.total, t.free, t.price_min, t.price_max)
                       AS snapshot
            FROM chessboard.projects p, truth t
            WHERE p.id = p_project_id
        ), changed AS (
            UPDATE chessboard.projects p
            SET property_objects_total_count = f.total, property_objects_free_count = f.free,
                price_min = f.price_min, price_max = f.price_max,
                published_snapshot = f.snapshot, version = p.version + 1, updated_at = now()
            FROM fresh f
            WHERE p.id = f.id
              AND ((p.property_objects_total_count, p.property_objects_free_count,
                    p.price_min, p.price_max)
                       IS DISTINCT FROM (f.total, f.free, f.price_min, f.price_max)
                   OR p.published_snapshot IS DISTINCT FROM f.snapshot)
            RETURNING p.id, p.version, p.published_snapshot
        ), published AS (
            INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
            SELECT 'pin.chessboard.project-upserted.v1', c.id::text,
                   chessboard.event_envelope(c.id, c.version) || c.published_snapshot,
                   p_traceparent
            FROM changed c
            RETURNING 1
        )
        SELECT count(*) INTO projects_published FROM published;

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
