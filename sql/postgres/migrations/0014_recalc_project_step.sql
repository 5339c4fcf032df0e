-- depends: 0013_recalc_claimed_project
-- One project, one statement, one transaction. The drain used to send per project a
-- claim (its own transaction), then BEGIN, recalc_claimed_project, the counters and COMMIT: two
-- commits and five statements, against a plain implementation's one transaction. Now a tick's
-- first project is claimed alone (claim_due_request, as before), and every project's work
-- transaction is one statement, recalc_project_step, that also
--   - records the outcome as the drain did in that transaction: release_claim for "deferred",
--     the failed run (attempt_count + 1, last_error) for "failed", and the counters;
--   - claims the tick's next project (p_claim_next), committed with this project's work.
-- So a project's attempt is still committed before its work starts (the claim of project n+1 is
-- durable with project n's COMMIT, and its work is the next statement), a drain that dies after
-- that COMMIT leaves a claim that settle_abandoned_claims counts, as after a claim of its own,
-- and a drain that stops between projects gives the claim in hand back (release_claim). The
-- queue protocol is the one model/recalc_queue.pml checks: the claim's own steps are unchanged,
-- only its COMMIT is shared with the previous project's.

-- The functions below are plpgsql, not sql: a sql function that is not inlined parses and plans
-- its body at every call, a plpgsql one plans each statement once per session.

-- The claim's statement (claim_due_request in recalc.sql, which calls it in a transaction of its
-- own, and recalc_project_step): one ready row, oldest due_at first, SKIP LOCKED, stamped
-- claimed_at (the attempt in progress) and attempted_at (the retry clock). Its comments are at
-- claim_due_request.
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
        WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts AND r.claimed_at IS NULL
          AND (r.attempted_at IS NULL OR r.attempted_at + s.retry_interval <= now())
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

-- The drain's counters (recalc.sql's record_recalc_outcome before: an upsert of up to seven
-- metric_counters rows per project, ~0.1 ms of the server's CPU, a tenth of a project's work).
-- Now a project's outcome is ONE row appended to recalc_outcomes in its work transaction (no
-- index, no conflict: ~0.02 ms), so a rolled-back project still counts nothing and a committed
-- one exactly once; each tick's end folds the committed rows into metric_counters in one
-- transaction (fold_recalc_outcomes), and the exporter reads both (metric_counter_rows), so a
-- scrape never sees a project twice or not at all, whether its row was folded yet or not.
CREATE TABLE chessboard.recalc_outcomes (
    -- runs_total{result}: counters.RESULT_LABELS' values, which the exporter serves
    result text NOT NULL,
    -- one histogram observation; NULL for "deferred", whose time is lock waiting
    duration float8,
    coalesced int NOT NULL,
    republished_project int NOT NULL,
    republished_layout int NOT NULL,
    republished_layout_group int NOT NULL
);

CREATE FUNCTION chessboard.record_recalc_outcome(
    p_result text, p_duration float8, p_coalesced int, p_project int, p_layout int,
    p_layout_group int
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chessboard.recalc_outcomes
    VALUES (p_result, p_duration, p_coalesced, p_project, p_layout, p_layout_group);
END
$$;

-- Outcome rows as counter increments (metric, label, value), as metric_counters names them:
-- runs{result}, coalesced_events, republished{entity}, duration_sum, duration_bucket{le} (the
-- smallest bucket bound at or above the duration, '+Inf' above them all); zero increments left
-- out.
CREATE FUNCTION chessboard.recalc_outcome_counters(p_rows chessboard.recalc_outcomes[])
RETURNS TABLE (metric text, label text, value float8)
LANGUAGE sql STABLE AS $$
    SELECT 'runs', o.result, count(*)::float8
    FROM unnest(p_rows) o
    GROUP BY o.result
    UNION ALL
    SELECT d.metric, d.label, d.value
    FROM (
        SELECT sum(o.coalesced)::float8 AS coalesced, sum(o.duration) AS duration,
               sum(o.republished_project)::float8 AS project,
               sum(o.republished_layout)::float8 AS layout,
               sum(o.republished_layout_group)::float8 AS layout_group
        FROM unnest(p_rows) o
    ) s,
    LATERAL (VALUES ('coalesced_events', '', s.coalesced), ('duration_sum', '', s.duration),
                    ('republished', 'project', s.project), ('republished', 'layout', s.layout),
                    ('republished', 'layout_group', s.layout_group)) AS d (metric, label, value)
    WHERE d.value <> 0
    UNION ALL
    SELECT 'duration_bucket', coalesce(b.le::text, '+Inf'), count(*)::float8
    FROM unnest(p_rows) o,
    LATERAL (SELECT min(k.le) AS le FROM chessboard.recalc_duration_buckets k
             WHERE k.le >= o.duration) b
    WHERE o.duration IS NOT NULL
    GROUP BY b.le;
$$;

-- A tick's end (counters.record_tick): the committed outcome rows taken and added to this
-- session's shard of metric_counters, in one transaction. Two drains folding at once take
-- disjoint rows (the second waits for the first's DELETE, then passes over what it deleted);
-- rows committed meanwhile wait for the next fold. Upserted in key order: no deadlock.
CREATE FUNCTION chessboard.fold_recalc_outcomes() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_taken chessboard.recalc_outcomes[];
BEGIN
    WITH taken AS (
        DELETE FROM chessboard.recalc_outcomes o RETURNING o.*
    )
    SELECT array_agg(ROW(t.*)::chessboard.recalc_outcomes) INTO v_taken FROM taken t;
    IF v_taken IS NOT NULL THEN
        INSERT INTO chessboard.metric_counters AS c (metric, label, shard, value)
        SELECT n.metric, n.label, mod(pg_backend_pid(), 16), n.value
        FROM chessboard.recalc_outcome_counters(v_taken) n
        ORDER BY n.metric, n.label
        ON CONFLICT (metric, label, shard) DO UPDATE SET value = c.value + excluded.value;
    END IF;
END
$$;

-- What the exporter (and the scale bench) sums: the folded counters and the outcome rows not
-- folded yet, read in one snapshot.
CREATE VIEW chessboard.metric_counter_rows AS
SELECT c.metric, c.label, c.value FROM chessboard.metric_counters c
UNION ALL
SELECT n.metric, n.label, n.value
FROM chessboard.recalc_outcome_counters(
    ARRAY(SELECT o FROM chessboard.recalc_outcomes o)) n;

-- A failure is stored as the drain used to name it: psycopg's exception class for the SQLSTATE
-- (PostgreSQL's condition name in CamelCase, e.g. RaiseException), then the error as libpq
-- prints it. The names are those of psycopg 3.3's errors module (PostgreSQL 15's errcodes.txt),
-- rows at the end of this file; an unknown state reads "SQLSTATE <code>".
CREATE TABLE chessboard.sqlstate_names (
    sqlstate char(5) PRIMARY KEY,
    name text NOT NULL
);

-- The work of one claimed project (migration 0013), its recompute and publication now one
-- statement; the rest (the re-lock of the claimed row, the savepoint, the up-front locks, the
-- delete, the outcomes and what it raises) as in 0013, whose comments say why.
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

        -- The four aggregate tables and the outbox in ONE statement (it was four, each with
        -- its own outbox INSERT): every outbox INSERT prepares the table's generated columns
        -- (migration 0005, outbox_event_defect inlined and planned), every statement its own
        -- executor start; one INSERT takes the three entities' events. The CTEs read one
        -- snapshot, and none reads what another writes: the drain writes only derived columns,
        -- and the group and project aggregates read the layouts' and objects' source columns.
        --
        -- Building counters are written but never published: they are not in the building
        -- event's payload. The three published entities share one rule (contract section 4): a
        -- row whose snapshot (its entity fields with the recomputed aggregates) differs from
        -- the one it last published, or whose aggregate columns differ from the truth, gets
        -- Version + 1 and an event in the same statement; any other row is left untouched, so a
        -- duplicate run writes nothing. The snapshot covers the row's own fields too: a renamed,
        -- re-sorted or archived group, a renamed project and a new row (published_snapshot
        -- NULL) are published although no aggregate moved. p_traceparent: the project span's
        -- W3C context, carried with its events (NULL: not traced).
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
        ), published AS (
            INSERT INTO chessboard.outbox_events (topic, message_key, payload, traceparent)
            SELECT c.topic, c.id::text,
                   chessboard.event_envelope(c.id, c.version) || c.published_snapshot,
                   p_traceparent
            FROM (SELECT * FROM layouts_changed
                  UNION ALL SELECT * FROM groups_changed
                  UNION ALL SELECT * FROM projects_changed) c
            RETURNING topic
        )
        SELECT (SELECT count(*) FROM buildings_changed),
               count(*) FILTER (WHERE topic = 'pin.chessboard.layout-upserted.v1'),
               count(*) FILTER (WHERE topic = 'pin.chessboard.layout-group-upserted.v1'),
               count(*) FILTER (WHERE topic = 'pin.chessboard.project-upserted.v1')
        INTO buildings_written, layouts_published, layout_groups_published, projects_published
        FROM published;

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

-- One claimed project's work transaction, as one statement the drain sends in autocommit. The
-- work is recalc_claimed_project (migration 0013: the claimed row re-locked, the savepoint, the
-- project's rows locked, the recompute, the publication, the request deleted); then, while the
-- claimed row is still held, its outcome is recorded; then, when p_claim_next, the next ready
-- project other than p_attempted and this one is claimed (the next_* columns; NULL when none).
-- What recalc_claimed_project raises (lock_not_available on the claimed row, a stop's cancel)
-- rolls the whole statement back, the next claim included: the drain gives this claim back.
-- duration_seconds: the work, from the statement's start to its outcome recorded (the
-- histogram's observation; NULL in the histogram for "deferred", whose time is lock waiting).
CREATE FUNCTION chessboard.recalc_project_step(
    p_project_id uuid, p_claimed_at timestamptz, p_previous_attempted_at timestamptz,
    p_requested_count int, p_traceparent text, p_lock_share float8, p_claim_next boolean,
    p_attempted uuid[]
) RETURNS TABLE (
    outcome text, duration_seconds float8, buildings_written int, layouts_published int,
    layout_groups_published int, projects_published int, error text, attempt_count int,
    next_project_id uuid, next_tenant_id uuid, next_last_reason text, next_requested_count int,
    next_attempt_count int, next_waited_seconds float8, next_claimed_at timestamptz,
    next_previous_attempted_at timestamptz
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
        CASE WHEN outcome IN ('recalculated', 'skipped_archived') THEN p_requested_count
             ELSE 0 END,
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

-- The raisers' UPDATE triggers skip the recalc's own writes: recalc_project_step sets
-- pin.recalc_write for its transaction while the work runs, so these statement triggers are not
-- even queued for its UPDATEs. They would find nothing: the recalc writes only the columns the
-- raisers leave out as derived (hierarchy_raise, projects_raise: aggregates, version,
-- updated_at, published_snapshot), so no project is ever enqueued by them; but each cost a
-- plpgsql call over its transition tables, four per project even when nothing changed:
-- 0.2-0.3 ms of the server's CPU per project, a fifth of the whole (bench_recalc, an ablation
-- with them disabled). Every other writer (an edit, the API, a migration) fires them as before; the
-- setting is transaction-local and named for this one purpose.
CREATE OR REPLACE TRIGGER buildings_raise_update AFTER UPDATE ON chessboard.buildings
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE OR REPLACE TRIGGER layouts_raise_update AFTER UPDATE ON chessboard.layouts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');
CREATE OR REPLACE TRIGGER layout_groups_raise_update AFTER UPDATE ON chessboard.layout_groups
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE OR REPLACE TRIGGER projects_raise_update AFTER UPDATE ON chessboard.projects
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.projects_raise();

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
