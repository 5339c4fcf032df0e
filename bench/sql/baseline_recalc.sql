-- The independent baseline of bench/bench_recalc.py: the plain per-project recalc a
-- team would write first, against which the drain's cost per project is measured. Created only
-- in the baseline's own bench database (schema bench_baseline); the product never uses it.
--
-- What a caller does per project (bench_recalc.py, baseline_drain): ONE transaction that claims
-- a due queue row (SELECT ... FOR UPDATE SKIP LOCKED), calls bench_baseline.recalc_project,
-- deletes the queue row and commits. No attempt counted at claim, no separate claim commit, no
-- lock of the project's rows up front, no metrics, no span.
--
-- The function recomputes the four aggregate tables from the project's own rows (spec 000,
-- step 4: the same formulas as tests/support/truth.py) and writes only the rows whose aggregates
-- changed (IS DISTINCT FROM guards). Each changed published row (layout, layout group, project)
-- gets Version + 1 and an outbox event in the same statement (a data-modifying WITH feeding the
-- INSERT), with the product's topics and payload: chessboard.event_envelope || the entity's
-- snapshot (the chessboard.*_snapshot functions of migration 0008). What it does not do is the
-- product's published-snapshot comparison: a row is written and published only when one of its
-- aggregates moved, so no snapshot is built for an unchanged row. It still stores the snapshot it
-- published in published_snapshot (it is built for the payload anyway), which keeps the two bench
-- databases row for row comparable.

CREATE SCHEMA IF NOT EXISTS bench_baseline;

CREATE OR REPLACE FUNCTION bench_baseline.recalc_project(p_project_id uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- An archived or deleted project carries no aggregates: they are left as they are.
    PERFORM 1 FROM chessboard.projects
    WHERE id = p_project_id AND status <> 'Archived' AND deleted_at IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    -- Buildings: live objects that are not Hidden, and the Free ones (never published).
    UPDATE chessboard.buildings b
    SET property_objects_total_count = t.total, property_objects_free_count = t.free,
        version = b.version + 1, updated_at = now()
    FROM (
        SELECT bb.id,
               count(po.id) FILTER (WHERE po.status <> 'Hidden') AS total,
               count(po.id) FILTER (WHERE po.status = 'Free') AS free
        FROM chessboard.buildings bb
        LEFT JOIN chessboard.property_objects po
               ON po.building_id = bb.id AND po.project_id = p_project_id
              AND po.deleted_at IS NULL
        WHERE bb.project_id = p_project_id
        GROUP BY bb.id
    ) t
    WHERE b.id = t.id
      AND (b.property_objects_total_count, b.property_objects_free_count)
          IS DISTINCT FROM (t.total, t.free);

    -- Layouts: live objects that are not Hidden.
    WITH changed AS (
        UPDATE chessboard.layouts l
        SET property_objects_count = t.objects,
            published_snapshot = chessboard.layout_snapshot(l, t.objects),
            version = l.version + 1, updated_at = now()
        FROM (
            SELECT ll.id, count(po.id)::int AS objects
            FROM chessboard.layouts ll
            LEFT JOIN chessboard.property_objects po
                   ON po.layout_id = ll.id AND po.project_id = p_project_id
                  AND po.deleted_at IS NULL AND po.status <> 'Hidden'
            WHERE ll.project_id = p_project_id
            GROUP BY ll.id
        ) t
        WHERE l.id = t.id AND l.property_objects_count IS DISTINCT FROM t.objects
        RETURNING l.id, l.version, l.published_snapshot
    )
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot
    FROM changed c;

    -- Layout groups: live layouts, and their area bounds.
    WITH changed AS (
        UPDATE chessboard.layout_groups g
        SET layouts_count = t.layouts, area_min = t.area_min, area_max = t.area_max,
            published_snapshot = chessboard.layout_group_snapshot(
                g, t.layouts, t.area_min, t.area_max),
            version = g.version + 1, updated_at = now()
        FROM (
            SELECT gg.id, count(l.id)::int AS layouts,
                   min(l.total_area) AS area_min, max(l.total_area) AS area_max
            FROM chessboard.layout_groups gg
            LEFT JOIN chessboard.layouts l
                   ON l.layout_group_id = gg.id AND l.project_id = p_project_id
                  AND l.deleted_at IS NULL
            WHERE gg.project_id = p_project_id
            GROUP BY gg.id
        ) t
        WHERE g.id = t.id
          AND (g.layouts_count, g.area_min, g.area_max)
              IS DISTINCT FROM (t.layouts, t.area_min, t.area_max)
        RETURNING g.id, g.version, g.published_snapshot
    )
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-group-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot
    FROM changed c;

    -- The project: live objects that are not Hidden, the Free ones and their price bounds.
    WITH changed AS (
        UPDATE chessboard.projects p
        SET property_objects_total_count = t.total, property_objects_free_count = t.free,
            price_min = t.price_min, price_max = t.price_max,
            published_snapshot = chessboard.project_snapshot(
                p, t.total, t.free, t.price_min, t.price_max),
            version = p.version + 1, updated_at = now()
        FROM (
            SELECT (count(*) FILTER (WHERE po.status <> 'Hidden'))::int AS total,
                   (count(*) FILTER (WHERE po.status = 'Free'))::int AS free,
                   min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
                   max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
            FROM chessboard.property_objects po
            WHERE po.project_id = p_project_id AND po.deleted_at IS NULL
        ) t
        WHERE p.id = p_project_id
          AND (p.property_objects_total_count, p.property_objects_free_count,
               p.price_min, p.price_max)
              IS DISTINCT FROM (t.total, t.free, t.price_min, t.price_max)
        RETURNING p.id, p.version, p.published_snapshot
    )
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.project-upserted.v1', c.id::text,
           chessboard.event_envelope(c.id, c.version) || c.published_snapshot
    FROM changed c;
END
$$;
