-- Chessboard tables (source fields + the denormalized aggregates the recalc owns), the debounce
-- queue of spec 000 and the transactional outbox. Writers insert source fields only; every
-- aggregate, version and timestamp column has a default.

CREATE SCHEMA IF NOT EXISTS chessboard;

CREATE TABLE chessboard.projects (
    id uuid PRIMARY KEY,
    tenant_id uuid NOT NULL,
    name text NOT NULL DEFAULT '',
    status text NOT NULL DEFAULT 'Draft'
        CHECK (status IN ('Draft', 'Published', 'Hidden', 'Archived')),
    deleted_at timestamptz,
    price_min numeric,
    price_max numeric,
    property_objects_total_count int NOT NULL DEFAULT 0,
    property_objects_free_count int NOT NULL DEFAULT 0,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE chessboard.buildings (
    id uuid PRIMARY KEY,
    project_id uuid NOT NULL REFERENCES chessboard.projects (id) ON DELETE CASCADE,
    name text NOT NULL DEFAULT '',
    deleted_at timestamptz,
    property_objects_total_count int NOT NULL DEFAULT 0,
    property_objects_free_count int NOT NULL DEFAULT 0,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_buildings_project ON chessboard.buildings (project_id);

CREATE TABLE chessboard.layout_groups (
    id uuid PRIMARY KEY,
    project_id uuid NOT NULL REFERENCES chessboard.projects (id) ON DELETE CASCADE,
    -- Filled from the project when a writer leaves it out (see fill_layout_group_tenant).
    tenant_id uuid NOT NULL,
    name text NOT NULL DEFAULT '',
    sort_order int NOT NULL DEFAULT 0,
    is_archived boolean NOT NULL DEFAULT false,
    layouts_count int NOT NULL DEFAULT 0,
    area_min numeric,
    area_max numeric,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_layout_groups_project ON chessboard.layout_groups (project_id);

CREATE TABLE chessboard.layouts (
    id uuid PRIMARY KEY,
    project_id uuid NOT NULL REFERENCES chessboard.projects (id) ON DELETE CASCADE,
    layout_group_id uuid REFERENCES chessboard.layout_groups (id) ON DELETE SET NULL,
    name text NOT NULL DEFAULT '',
    total_area numeric NOT NULL DEFAULT 0,
    deleted_at timestamptz,
    property_objects_count int NOT NULL DEFAULT 0,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_layouts_project ON chessboard.layouts (project_id);
CREATE INDEX ix_layouts_group ON chessboard.layouts (layout_group_id);

CREATE TABLE chessboard.property_objects (
    id uuid PRIMARY KEY,
    project_id uuid NOT NULL REFERENCES chessboard.projects (id) ON DELETE CASCADE,
    building_id uuid NOT NULL REFERENCES chessboard.buildings (id) ON DELETE CASCADE,
    layout_id uuid REFERENCES chessboard.layouts (id) ON DELETE SET NULL,
    status text NOT NULL DEFAULT 'Free'
        CHECK (status IN ('Free', 'Booked', 'Sold', 'Hidden', 'Reserved', 'Unavailable')),
    price numeric NOT NULL DEFAULT 0,
    deleted_at timestamptz,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- Without these, each per-project aggregate scans every object of every project.
CREATE INDEX ix_property_objects_project ON chessboard.property_objects (project_id);
CREATE INDEX ix_property_objects_building ON chessboard.property_objects (building_id);
CREATE INDEX ix_property_objects_layout ON chessboard.property_objects (layout_id);

CREATE FUNCTION chessboard.fill_layout_group_tenant() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS NULL THEN
        SELECT p.tenant_id INTO NEW.tenant_id FROM chessboard.projects p WHERE p.id = NEW.project_id;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER layout_groups_fill_tenant BEFORE INSERT ON chessboard.layout_groups
    FOR EACH ROW EXECUTE FUNCTION chessboard.fill_layout_group_tenant();

-- ---------------------------------------------------------------------------------------------
-- The debounce queue (spec 000, ProjectRecalcRequest): one row per project = the coalescing unit.

CREATE TABLE chessboard.recalc_settings (
    -- A single row: every enqueue path reads the same thresholds.
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    debounce interval NOT NULL DEFAULT '30 seconds',
    starvation_cap interval NOT NULL DEFAULT '5 minutes',
    batch_size int NOT NULL DEFAULT 50 CHECK (batch_size > 0),
    poison_attempts int NOT NULL DEFAULT 5 CHECK (poison_attempts > 0),
    -- A failed row is retried no sooner than this after its failure (the spec's "next tick").
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
    attempt_count int NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    last_error varchar(1024),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_project_recalc_due ON chessboard.project_recalc_requests (due_at);

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

-- Statement-level raisers: a bulk statement enqueues each touched project once, not once per row.
-- Locks are taken in project_id order so two bulk writers cannot deadlock on the queue.
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

-- layouts, buildings and layout groups: any change of a source field; the recalc's own writes
-- (counters, bounds, version, updated_at) are excluded, or every drain would enqueue again.
CREATE FUNCTION chessboard.hierarchy_raise() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    reason text := TG_ARGV[0];
    derived text[] := ARRAY['version', 'updated_at', 'property_objects_count',
                            'property_objects_total_count', 'property_objects_free_count',
                            'layouts_count', 'area_min', 'area_max'];
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

-- Transition tables allow one event per trigger, hence three triggers per table.
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
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');
CREATE TRIGGER layouts_raise_delete AFTER DELETE ON chessboard.layouts
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('LayoutChanged');

CREATE TRIGGER buildings_raise_insert AFTER INSERT ON chessboard.buildings
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE TRIGGER buildings_raise_update AFTER UPDATE ON chessboard.buildings
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
CREATE TRIGGER buildings_raise_delete AFTER DELETE ON chessboard.buildings
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');

-- A layout group moved to another project changes both projects' group aggregates; the spec names
-- no raiser for groups, so only updates raise (reason Crud).
CREATE TRIGGER layout_groups_raise_update AFTER UPDATE ON chessboard.layout_groups
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');

-- ---------------------------------------------------------------------------------------------
-- Transactional outbox: the drain writes snapshot events in the same transaction as the
-- aggregates; the relay publishes them after commit and deletes them once the broker acked.

CREATE TABLE chessboard.outbox_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    message_key text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
