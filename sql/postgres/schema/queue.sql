-- The debounce queue (spec 000, ProjectRecalcRequest): one row per project is the coalescing
-- unit. Edits enqueue through the raisers' statement triggers; the drain (recalc.sql) claims,
-- recomputes and deletes rows.

CREATE TABLE chessboard.recalc_settings (
    -- A single row: every enqueue path reads the same thresholds.
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    debounce interval NOT NULL DEFAULT '30 seconds',
    starvation_cap interval NOT NULL DEFAULT '5 minutes',
    batch_size int NOT NULL DEFAULT 50 CHECK (batch_size > 0),
    poison_attempts int NOT NULL DEFAULT 5 CHECK (poison_attempts > 0),
    -- A failed row is retried no sooner than this after its attempt started (the spec's "next
    -- tick"); also how long a claim may stay unlocked before it counts as abandoned.
    retry_interval interval NOT NULL DEFAULT '5 seconds'
);
INSERT INTO chessboard.recalc_settings DEFAULT VALUES;

CREATE TABLE chessboard.project_recalc_requests (
    project_id uuid PRIMARY KEY,
    tenant_id uuid NOT NULL,
    due_at timestamptz NOT NULL,
    first_requested_at timestamptz NOT NULL,
    requested_count int NOT NULL DEFAULT 1 CHECK (requested_count >= 1),
    last_reason varchar(32) NOT NULL CHECK (last_reason IN (
        'PropertyObjectStatusChanged', 'PropertyObjectPriceChanged', 'PropertyObjectUpserted',
        'LayoutChanged', 'TalentSync', 'Crud', 'Manual', 'Reconcile')),
    -- Failed runs (spec 000: "Число неуспешных прогонов"): counted when a failure is recorded
    -- or an abandoned claim is settled, never while an attempt runs; poison_attempts parks it.
    attempt_count int NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    last_error varchar(1024),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- When the last attempt started: the retry clock. Only a claim writes it, so edits that keep
    -- arriving (they bump updated_at and push due_at) never postpone a retry past the cap.
    attempted_at timestamptz,
    -- The attempt in progress, set by the claim's committed transaction and cleared by its
    -- outcome (a success deletes the row). It is also the claim's identity: the work and the
    -- give-back match on it, so a claim settled as abandoned is never touched by its late drain.
    claimed_at timestamptz
);
CREATE INDEX ix_project_recalc_due ON chessboard.project_recalc_requests (due_at);
-- settle_abandoned_claims (queries/recalc.sql) looks only at claimed rows: almost always none.
CREATE INDEX ix_project_recalc_claimed ON chessboard.project_recalc_requests (claimed_at)
    WHERE claimed_at IS NOT NULL;

-- Trailing debounce: a new row is due after `debounce`; every later request pushes due_at out by
-- `debounce` again, but never past first_requested_at + starvation_cap. A request that arrives
-- while a drain holds the row waits for that drain's commit; the row is gone by then, so
-- ON CONFLICT finds no conflict and inserts a fresh row: the request is not lost.
CREATE FUNCTION chessboard.request_project_recalc(project_id uuid, tenant_id uuid, reason text)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO chessboard.project_recalc_requests AS r
        (project_id, tenant_id, due_at, first_requested_at, requested_count, last_reason)
    SELECT request_project_recalc.project_id, request_project_recalc.tenant_id,
           now() + s.debounce, now(), 1, request_project_recalc.reason
    FROM chessboard.recalc_settings s
    ON CONFLICT ON CONSTRAINT project_recalc_requests_pkey DO UPDATE SET
        due_at = least(now() + (SELECT debounce FROM chessboard.recalc_settings),
                       r.first_requested_at + (SELECT starvation_cap FROM chessboard.recalc_settings)),
        requested_count = r.requested_count + 1,
        last_reason = excluded.last_reason,
        tenant_id = excluded.tenant_id,
        updated_at = now();
$$;

-- A queue row's states, each written once here and used wherever the queue is read: the claim
-- (recalc.sql), the next-due wait below, the poison view, the tick's count and the exporter's
-- gauges (queries/), the reconciliation's queue state. Scalar sql functions of the row: the
-- planner inlines them into the calling query, so `r.due_at <= now()` stays an index condition
-- of the claim (tests/integration/test_recalc_request_states.py).
--
-- Poisoned: parked for triage. attempt_count reaches poison_attempts only when an attempt's
-- failure is recorded (or an abandoned claim settled), never while an attempt runs, so no row
-- lock is needed to leave a last attempt in flight out: a reader such as the exporter needs
-- SELECT only.
CREATE FUNCTION chessboard.recalc_request_poisoned(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT r.attempt_count >= s.poison_attempts;
$$;

-- Due: its time has come and it is not poisoned. The backlogs count these, a row waiting for
-- its retry or in a drain's hands included.
CREATE FUNCTION chessboard.recalc_request_due(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT r.due_at <= now() AND NOT chessboard.recalc_request_poisoned(r, s);
$$;

-- When it can next be claimed, a claim in progress aside: when it is due, and no sooner than
-- retry_interval after its last attempt started (the retry clock, which only a claim writes, so
-- edits that keep arriving never postpone a retry). greatest() skips the NULL of a row never
-- attempted.
CREATE FUNCTION chessboard.recalc_request_ready_at(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT greatest(r.due_at, r.attempted_at + s.retry_interval);
$$;

-- Ready: what a claim takes. Due, no attempt in progress, its retry time come.
CREATE FUNCTION chessboard.recalc_request_ready(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT chessboard.recalc_request_due(r, s) AND r.claimed_at IS NULL
       AND chessboard.recalc_request_ready_at(r, s) <= now();
$$;

-- Rows parked for triage.
CREATE FUNCTION chessboard.poisoned_recalc_requests()
RETURNS SETOF chessboard.project_recalc_requests
LANGUAGE sql STABLE AS $$
    SELECT r.*
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE chessboard.recalc_request_poisoned(r, s);
$$;

-- The seconds until the next row is ready (<= 0: now; NULL: nothing but poison is queued): read
-- by the scheduler's tick with its beat in one statement, and by the drain's wait for a row.
CREATE FUNCTION chessboard.recalc_next_due_in_seconds() RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT extract(epoch FROM min(chessboard.recalc_request_ready_at(r, s)) - now())::float8
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE NOT chessboard.recalc_request_poisoned(r, s);
$$;

-- ---------------------------------------------------------------------------------------------
-- The raisers. Statement-level: a bulk statement enqueues each touched project once, not once
-- per row. Locks are taken in project_id order so two bulk writers cannot deadlock on the queue.
CREATE FUNCTION chessboard.enqueue_touched_projects(touched_project_ids uuid[], reason text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    p record;
BEGIN
    FOR p IN
        SELECT pr.id, pr.tenant_id FROM chessboard.projects pr
        WHERE pr.id = ANY (touched_project_ids) ORDER BY pr.id
    LOOP
        PERFORM chessboard.request_project_recalc(p.id, p.tenant_id, reason);
    END LOOP;
END
$$;

-- property_objects: status change wins over price change, which wins over any other change.
CREATE FUNCTION chessboard.property_objects_raise() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM chessboard.enqueue_touched_projects(
            ARRAY(SELECT DISTINCT n.project_id FROM new_rows n), 'PropertyObjectUpserted');
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM chessboard.enqueue_touched_projects(
            ARRAY(SELECT DISTINCT o.project_id FROM old_rows o), 'PropertyObjectUpserted');
    ELSE
        FOR r IN
            WITH changed AS (
                SELECT o.project_id AS old_project, n.project_id AS new_project,
                       CASE WHEN o.status IS DISTINCT FROM n.status THEN 3
                            WHEN o.price IS DISTINCT FROM n.price THEN 2
                            ELSE 1 END AS rank
                FROM old_rows o JOIN new_rows n USING (id)
                WHERE to_jsonb(o) - 'version' - 'updated_at'
                      IS DISTINCT FROM to_jsonb(n) - 'version' - 'updated_at'
            ), sides AS (
                SELECT old_project AS project_id, rank FROM changed
                UNION ALL
                SELECT new_project, rank FROM changed
            )
            SELECT pr.id, pr.tenant_id, max(sides.rank) AS rank
            FROM sides JOIN chessboard.projects pr ON pr.id = sides.project_id
            GROUP BY pr.id, pr.tenant_id ORDER BY pr.id
        LOOP
            PERFORM chessboard.request_project_recalc(r.id, r.tenant_id,
                CASE r.rank WHEN 3 THEN 'PropertyObjectStatusChanged'
                            WHEN 2 THEN 'PropertyObjectPriceChanged'
                            ELSE 'PropertyObjectUpserted' END);
        END LOOP;
    END IF;
    RETURN NULL;
END
$$;

-- layouts, buildings and layout groups: any change of a source field, in the old and the new
-- project of a moved row. The recalc's own writes (counters, bounds, version, updated_at,
-- published_snapshot) are excluded, or every drain would enqueue again; so is a group's
-- tenant_id, its project's developer copied by the catalogue's triggers (catalogue.sql): a
-- developer change is the project's edit, enqueued once by projects_raise.
CREATE FUNCTION chessboard.hierarchy_raise() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    reason text := TG_ARGV[0];
    derived text[] := ARRAY['version', 'updated_at', 'property_objects_count',
                            'property_objects_total_count', 'property_objects_free_count',
                            'layouts_count', 'area_min', 'area_max', 'published_snapshot',
                            'tenant_id'];
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM chessboard.enqueue_touched_projects(
            ARRAY(SELECT DISTINCT n.project_id FROM new_rows n), reason);
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM chessboard.enqueue_touched_projects(
            ARRAY(SELECT DISTINCT o.project_id FROM old_rows o), reason);
    ELSE
        PERFORM chessboard.enqueue_touched_projects(ARRAY(
            SELECT DISTINCT side.project_id
            FROM old_rows o JOIN new_rows n USING (id)
            CROSS JOIN LATERAL (VALUES (o.project_id), (n.project_id)) AS side (project_id)
            WHERE to_jsonb(o) - derived IS DISTINCT FROM to_jsonb(n) - derived
        ), reason);
    END IF;
    RETURN NULL;
END
$$;

-- A project's own fields: a new project is published once; a rename or a status change is
-- published; a restore (status back from Archived, deleted_at cleared) is recomputed, since an
-- archived project's aggregates were left as they were. The drain's writes never enqueue.
CREATE FUNCTION chessboard.projects_raise() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    derived text[] := ARRAY['version', 'updated_at', 'price_min', 'price_max',
                            'property_objects_total_count', 'property_objects_free_count',
                            'published_snapshot'];
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM chessboard.enqueue_touched_projects(ARRAY(SELECT n.id FROM new_rows n), 'Crud');
    ELSE
        PERFORM chessboard.enqueue_touched_projects(ARRAY(
            SELECT n.id
            FROM old_rows o JOIN new_rows n USING (id)
            WHERE to_jsonb(o) - derived IS DISTINCT FROM to_jsonb(n) - derived
        ), 'Crud');
    END IF;
    RETURN NULL;
END
$$;

-- Transition tables allow one event per trigger, hence a trigger per event.
--
-- The UPDATE triggers of the tables the recalc writes skip its own writes: recalc_project_step
-- sets pin.recalc_write for its transaction while the work runs, so these triggers are not even
-- queued for its UPDATEs. They would find nothing (the recalc writes only the columns the
-- raisers leave out as derived), but each cost a plpgsql call over its transition tables, four
-- per project even when nothing changed: a fifth of a project's server CPU. Every other writer
-- (an edit, the API, a migration) fires them; the setting is transaction-local and named for
-- this one purpose.
CREATE TRIGGER property_objects_raise_insert AFTER INSERT ON chessboard.property_objects
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.property_objects_raise();
CREATE TRIGGER property_objects_raise_update AFTER UPDATE ON chessboard.property_objects
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.property_objects_raise();
CREATE TRIGGER property_objects_raise_delete AFTER DELETE ON chessboard.property_objects
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.property_objects_raise();

CREATE TRIGGER layouts_raise_insert AFTER INSERT ON chessboard.layouts
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');
CREATE TRIGGER layouts_raise_update AFTER UPDATE ON chessboard.layouts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');
CREATE TRIGGER layouts_raise_delete AFTER DELETE ON chessboard.layouts
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');

CREATE TRIGGER buildings_raise_insert AFTER INSERT ON chessboard.buildings
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE TRIGGER buildings_raise_update AFTER UPDATE ON chessboard.buildings
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE TRIGGER buildings_raise_delete AFTER DELETE ON chessboard.buildings
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');

-- Layout groups: a new group is published once, even before it has layouts; a group moved to
-- another project changes both projects' group aggregates. The spec names no raiser for a
-- group's delete.
CREATE TRIGGER layout_groups_raise_insert AFTER INSERT ON chessboard.layout_groups
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE TRIGGER layout_groups_raise_update AFTER UPDATE ON chessboard.layout_groups
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');

CREATE TRIGGER projects_raise_insert AFTER INSERT ON chessboard.projects
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.projects_raise();
CREATE TRIGGER projects_raise_update AFTER UPDATE ON chessboard.projects
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (current_setting('pin.recalc_write', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION chessboard.projects_raise();
