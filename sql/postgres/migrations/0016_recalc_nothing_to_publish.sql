-- depends: 0015_inlined_snapshots
-- A project with nothing to publish neither starts an outbox INSERT nor waits for the WAL
-- flush at its commit. Measured on a drain's backend over steady projects (nothing
-- changed, nothing published), each alone:
--
-- * Every INSERT into outbox_events prepares the table's stored generated columns when its
--   executor starts (migration 0005: outbox_event_defect is inlined, so its body is parsed and
--   planned each time), zero rows or not, and recalc_claimed_project's one statement always had
--   an INSERT in it: 8 % of the backend's `perf` samples were that preparation. Now the four
--   aggregate UPDATEs return the changed rows as arrays and the INSERT runs only when there are
--   any: backend CPU 0.84 -> 0.75 ms per project with 1 worker, 0.92 -> 0.81 ms with 2
--   (bench_recalc's steady passes). A project with events pays one more statement start.
-- * The commit's fdatasync of the WAL was 11 % of the samples. A transaction that wrote no
--   event now commits with synchronous_commit off, as the claim already does (claim_due_request
--   in recalc.sql): 0.72 -> 0.65 ms with 1 worker, 0.79 -> 0.70 ms with 2. Only a server crash
--   within a fraction of a second (3 × wal_writer_delay at most) can forget such a commit, and
--   what it forgets is a recompute that published nothing: the queue row is back, the claim in
--   it is settled as an abandoned attempt (settle_abandoned_claims, as for a drain that died) and
--   the project is recomputed; counters lose its outcome row. A transaction that wrote events
--   still waits for the flush: the relay may read and send its events as soon as it commits, so
--   a crash must not be able to take them back.
--
-- Everything else is 0014's function, whose comments say why.

CREATE OR REPLACE FUNCTION chessboard.recalc_claimed_project(
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

        -- The four aggregate tables in ONE statement (it was four): every statement has its
        -- own executor start. The CTEs read one snapshot, and none reads what another writes:
        -- the drain writes only derived columns, and the group and project aggregates read the
        -- layouts' and objects' source columns. The changed rows come back as arrays, and the
        -- outbox INSERT below takes the three entities' events, only when there are any (see
        -- the migration's header).
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
            -- for the WAL flush (see the migration's header).
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
