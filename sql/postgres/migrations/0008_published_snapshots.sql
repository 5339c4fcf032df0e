-- depends: 0006_recalc_claims
-- Every change of a published snapshot is published (contract section 4).
--
-- The drain used to publish a row only when its aggregates changed, so a renamed, re-sorted or
-- archived layout group (or a renamed project, or a new group with no layouts) never reached its
-- consumers. Each published row now keeps the entity fields of the snapshot it last published;
-- the drain publishes (with Version + 1) every row whose current snapshot differs from it. NULL =
-- never published, so a new row is published once. Rows that exist when this migration runs are
-- republished once, by the first drain of their project (at-least-once: consumers upsert by Id
-- and Version).

ALTER TABLE chessboard.projects ADD COLUMN published_snapshot jsonb;
ALTER TABLE chessboard.layouts ADD COLUMN published_snapshot jsonb;
ALTER TABLE chessboard.layout_groups ADD COLUMN published_snapshot jsonb;

-- The entity fields of each event (the envelope is chessboard.event_envelope). The aggregates are
-- parameters: the drain compares the snapshot with the values it is about to write, in the same
-- statement that writes them.
CREATE FUNCTION chessboard.project_snapshot(
    p chessboard.projects, total_count int, free_count int, price_min numeric, price_max numeric
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'TenantId', p.tenant_id,
        'Name', p.name,
        'Status', p.status,
        'PriceMin', price_min,
        'PriceMax', price_max,
        'PropertyObjectsTotalCount', total_count,
        'PropertyObjectsFreeCount', free_count);
$$;

CREATE FUNCTION chessboard.layout_snapshot(l chessboard.layouts, objects_count int)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'ProjectId', l.project_id,
        'LayoutGroupId', l.layout_group_id,
        'Name', l.name,
        'TotalArea', l.total_area,
        'PropertyObjectsCount', objects_count,
        'IsDeleted', l.deleted_at IS NOT NULL);
$$;

CREATE FUNCTION chessboard.layout_group_snapshot(
    g chessboard.layout_groups, layouts_count int, area_min numeric, area_max numeric
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'ProjectId', g.project_id,
        'TenantId', g.tenant_id,
        'Name', g.name,
        'SortOrder', g.sort_order,
        'IsArchived', g.is_archived,
        'LayoutsCount', layouts_count,
        'AreaMin', area_min,
        'AreaMax', area_max);
$$;

-- The reconciliation's re-publish builds the same event from the row as stored.
CREATE OR REPLACE FUNCTION chessboard.layout_group_payload(g chessboard.layout_groups)
RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT chessboard.event_envelope(g.id, g.version)
           || chessboard.layout_group_snapshot(g, g.layouts_count, g.area_min, g.area_max);
$$;

-- The drain's own writes (aggregates, version, updated_at, published_snapshot) never enqueue.
CREATE OR REPLACE FUNCTION chessboard.hierarchy_raise() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    reason text := TG_ARGV[0];
    derived text[] := ARRAY['version', 'updated_at', 'property_objects_count',
                            'property_objects_total_count', 'property_objects_free_count',
                            'layouts_count', 'area_min', 'area_max', 'published_snapshot'];
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

-- A new layout group is published once, even before it has layouts.
CREATE TRIGGER layout_groups_raise_insert AFTER INSERT ON chessboard.layout_groups
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');

-- A project's own fields: a new project is published once; a rename or a status change is
-- published; a restore (status back from Archived, deleted_at cleared) is recomputed, since an
-- archived project's aggregates were left as they were. Its aggregates, version, updated_at and
-- published_snapshot are the drain's writes and never enqueue.
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

CREATE TRIGGER projects_raise_insert AFTER INSERT ON chessboard.projects
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.projects_raise();
CREATE TRIGGER projects_raise_update AFTER UPDATE ON chessboard.projects
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.projects_raise();
