-- The chessboard's source tables: the catalogue writers own their source fields; the
-- denormalized aggregates, versions, timestamps and published_snapshot are the recalc's, and
-- every one of them has a default, so a writer inserts source fields only.
--
-- Each published entity keeps published_snapshot: the entity fields of the event it last
-- published (NULL: never published). The recalc publishes, with Version + 1, every row whose
-- current snapshot differs from it (outbox.sql's *_snapshot builders).

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
    updated_at timestamptz NOT NULL DEFAULT now(),
    published_snapshot jsonb
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
    -- The project's developer (spec 003 INV-DIM-LG-2: "up the hierarchy"), never the
    -- writer's: kept equal to projects.tenant_id by layout_group_follows_project and
    -- project_tenant_to_layout_groups below.
    tenant_id uuid NOT NULL,
    name text NOT NULL DEFAULT '',
    sort_order int NOT NULL DEFAULT 0,
    is_archived boolean NOT NULL DEFAULT false,
    layouts_count int NOT NULL DEFAULT 0,
    area_min numeric,
    area_max numeric,
    version bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    published_snapshot jsonb
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
    updated_at timestamptz NOT NULL DEFAULT now(),
    published_snapshot jsonb
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
-- Without it each per-project aggregate scans every object of every project.
CREATE INDEX ix_property_objects_project ON chessboard.property_objects (project_id);
-- The recompute joins each building and layout of a project to its objects on (building_id,
-- project_id) and (layout_id, project_id). With one index per column the planner answers each
-- lookup with a BitmapAnd that reads the whole project's range of ix_property_objects_project
-- once per building or layout; in a large catalogue (10M objects) that doubles a big project's
-- recompute. Both columns make each lookup one exact index scan. They also serve the foreign
-- keys' cascades from buildings and layouts (leading column), so no single-column index is kept.
CREATE INDEX ix_property_objects_building_project
    ON chessboard.property_objects (building_id, project_id);
CREATE INDEX ix_property_objects_layout_project
    ON chessboard.property_objects (layout_id, project_id);

-- A group's developer is its project's, and the events carry it (layout_group_snapshot), so
-- it is kept in the row, right from the writer's own commit, rather than looked up when a
-- snapshot is built: any reader of the row, the drain, the reconciliation's re-publish and a
-- previous release's code all read the same true value, and the snapshot builders stay
-- expressions of the row (a sub-select would stop the planner inlining them into the drain).
-- Two triggers keep it:
--
-- layout_group_follows_project: on insert and on a move to another project (or a write of
-- tenant_id itself), the row takes its project's developer, whatever the writer gave. The
-- project row is read FOR SHARE: a developer change of that project in flight (which rewrites
-- the groups it can see, below) is waited for and its new developer read; one that starts
-- later waits for this transaction and then sees the group. Without the lock the two could
-- miss each other and leave the group with the old developer. A project that does not exist
-- leaves the row as written (the foreign key then refuses it).
CREATE FUNCTION chessboard.layout_group_follows_project() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_tenant_id uuid;
BEGIN
    SELECT p.tenant_id INTO v_tenant_id
    FROM chessboard.projects p WHERE p.id = NEW.project_id
    FOR SHARE;
    IF FOUND THEN
        NEW.tenant_id := v_tenant_id;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER layout_groups_follow_project_insert BEFORE INSERT ON chessboard.layout_groups
    FOR EACH ROW EXECUTE FUNCTION chessboard.layout_group_follows_project();
CREATE TRIGGER layout_groups_follow_project_update
    BEFORE UPDATE OF project_id, tenant_id ON chessboard.layout_groups
    FOR EACH ROW EXECUTE FUNCTION chessboard.layout_group_follows_project();

-- project_tenant_to_layout_groups: a project passed to another developer passes its groups, in
-- the same statement's transaction (one set-based UPDATE per project). The project's own raiser
-- enqueues it (projects_raise); its drain then publishes every group whose snapshot's TenantId
-- moved. hierarchy_raise counts tenant_id among the derived columns, so these writes add no
-- second request.
CREATE FUNCTION chessboard.project_tenant_to_layout_groups() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE chessboard.layout_groups g
    SET tenant_id = NEW.tenant_id
    WHERE g.project_id = NEW.id AND g.tenant_id IS DISTINCT FROM NEW.tenant_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER projects_tenant_to_layout_groups AFTER UPDATE OF tenant_id ON chessboard.projects
    FOR EACH ROW WHEN (OLD.tenant_id IS DISTINCT FROM NEW.tenant_id)
    EXECUTE FUNCTION chessboard.project_tenant_to_layout_groups();

-- JIT compilation is for long analytical queries. The recompute of a big project crosses
-- jit_above_cost once the table is large (the planner prices its bitmap scan of a project's
-- rows as random page reads) and then spends 25-50 ms compiling a statement that runs in 50.
-- Nothing on this database benefits: the API's statements are small and the reconciliation's
-- full scan stays far below its goal without it. ALTER DATABASE needs the database's owner (or
-- a superuser); a role that only has CREATE on it leaves JIT on, with a warning that says what
-- to run.
DO $$
BEGIN
    IF pg_has_role(current_user,
                   (SELECT datdba FROM pg_database WHERE datname = current_database()),
                   'USAGE') THEN
        EXECUTE format('ALTER DATABASE %I SET jit = off', current_database());
    ELSE
        RAISE WARNING 'jit stays on for database %: % does not own it. As its owner, run: ALTER DATABASE % SET jit = off',
            current_database(), current_user, quote_ident(current_database());
    END IF;
END
$$;
