-- depends: 0021_bounded_handlers
-- A group's developer follows its project (spec 003 INV-DIM-LG-2: DeveloperId is TenantId, "the
-- project's DeveloperId, up the hierarchy"). layout_groups.tenant_id was copied from the project
-- only when a group was inserted without one: a project passed to another developer, or a group
-- moved into another developer's project, kept the old developer in the row, and so in every
-- later layout-group event and in dim_layout_group, where the new owner could not read the group
-- and the old one still could.
--
-- The column stays, kept right by triggers, rather than being looked up from the project when a
-- snapshot is built: the contract lists it (section 3) and a reader of the row must find the
-- truth, not what the next drain will make of it; the snapshot builders, the drain and the
-- reconciliation's re-publish read it unchanged (a previous release's code included), and the
-- builders stay expressions of the row that the planner inlines into the drain's one statement
-- (a sub-select per row would not be). The cost lies with the rare hierarchy edits: a developer
-- change rewrites its project's groups (hundreds at most, spec 003) in the writer's
-- transaction, and a group insert or move reads its project FOR SHARE
-- (sql/postgres/schema/catalogue.sql says why).
--
-- Rows the defect left with another developer than their project's are set right here, and
-- their projects enqueued first (the drain's lock order: queue row, then the project's rows), so
-- the drain publishes their groups with the project's developer.
-- Online: two triggers replaced by three (short table locks), one function replaced, and an
-- UPDATE of the stale rows only.

DROP TRIGGER layout_groups_fill_tenant ON chessboard.layout_groups;
DROP FUNCTION chessboard.fill_layout_group_tenant();

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

CREATE OR REPLACE FUNCTION chessboard.hierarchy_raise() RETURNS trigger
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

SELECT chessboard.enqueue_touched_projects(ARRAY(
    SELECT DISTINCT g.project_id
    FROM chessboard.layout_groups g JOIN chessboard.projects p ON p.id = g.project_id
    WHERE g.tenant_id <> p.tenant_id
), 'Crud');
UPDATE chessboard.layout_groups g
SET tenant_id = p.tenant_id
FROM chessboard.projects p
WHERE p.id = g.project_id AND g.tenant_id <> p.tenant_id;
