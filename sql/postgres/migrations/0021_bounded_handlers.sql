-- depends: 0020_relay_events_beyond_source
-- Every wait in the drain's handlers bounded, and the coalesced requests counted exactly
-- (issue 49).
--
-- * recalc_tick's handlers waited for the claimed row without a bound: the work's lock_timeout
--   is set inside the project's block, whose rollback undoes it, and the drain's session sets
--   none. After lock_not_available, release_claim waited for the very writer that held the row,
--   and past the call's statement timeout the CALL failed (the drain run with it) and the claim
--   stayed, which the next tick's settle counted as a failed run: contention moved a project
--   towards poison. After the statement timeout, record_recalc_timeout waited with no timeout
--   armed at all (it does not fire twice), holding the tick past 30 s for as long as the writer
--   ran; after a stop, the give-back could outlast the stop and count a deploy as a failed run.
--   Now every handler ends its attempt through end_claim, which waits for the row at most until
--   a second before the call's statement timeout (lock_not_available) or not at all (after a
--   cancel), and otherwise writes the end to recalc_pending_claim_ends, which the next tick's
--   settle (queries/recalc.sql:settle_abandoned_claims) applies once the writer is gone, never
--   counting such a claim as abandoned.
-- * chessboard_recalc_coalesced_events_total added the requested_count read at claim time: a
--   request landing between the claim's commit and the work's lock of the row was served (the
--   work deletes the row) and never counted. recalc_claimed_project now reads the count under
--   its lock (requests_served), and recalc_project_step counts that.
--
-- * recalc_tick told the statement timeout's cancel from a stop's by the call's age reaching the
--   timeout; statement_timestamp() is the Execute message's, a little after the timeout was armed,
--   so a timeout could be read as a stop (its failed run given back): now half a second short of
--   the timeout is the timeout's (a stop's cancel comes a second before it at the latest).
--
-- recalc_claimed_project and recalc_project_step return one more column, so they are dropped and
-- created again with the same arguments, in this transaction: a drain of the previous release
-- in the middle of a call finds the new ones by the same signature (its plans are invalidated
-- with the old functions) and reads the columns it knows. Nothing takes a lock on a function:
-- no worker waits for this migration. Everything else is 0018's, whose comments say why.

CREATE TABLE chessboard.recalc_pending_claim_ends (
    project_id uuid NOT NULL,
    claimed_at timestamptz NOT NULL,
    previous_attempted_at timestamptz,
    error varchar(1024),
    PRIMARY KEY (project_id, claimed_at)
);

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

DROP FUNCTION chessboard.recalc_claimed_project(uuid, timestamptz, text, float8);
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

DROP FUNCTION chessboard.recalc_project_step(
    uuid, timestamptz, timestamptz, int, text, float8, boolean, uuid[]);
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

CREATE OR REPLACE FUNCTION chessboard.record_recalc_timeout(
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

CREATE OR REPLACE PROCEDURE chessboard.recalc_tick(
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
