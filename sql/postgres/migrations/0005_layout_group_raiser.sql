-- A layout group moved to another project changes both projects' group aggregates, and the spec
-- names no raiser for groups: the group table gets the same statement-level raisers (reason Crud).
-- The recalc's own group columns join the excluded list, or every drain would re-enqueue.
-- depends: 0001_chessboard_schema

CREATE OR REPLACE FUNCTION chessboard.hierarchy_raise() RETURNS trigger
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

CREATE TRIGGER layout_groups_raise_update AFTER UPDATE ON chessboard.layout_groups
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.hierarchy_raise('Crud');
