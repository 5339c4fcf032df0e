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
    -- Filled from the project when a writer leaves it out (fill_layout_group_tenant).
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
