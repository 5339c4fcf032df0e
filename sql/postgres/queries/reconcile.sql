-- Named queries of the drift reconciliation. Parameters are :named (aiosql).
--
-- The truth here is written independently of the drain (recalc.sql) on purpose: one wrong
-- predicate must not hide in both. Where the drain joins each entity to its objects per project,
-- this file aggregates the live objects ONCE for every project (GROUPING SETS) and compares the
-- result with the stored columns of all non-archived projects in one set-based pass.
--
-- Definitions (spec 000, step 4): free = not soft-deleted AND status 'Free'; active = not
-- soft-deleted AND status <> 'Hidden'; live layout = not soft-deleted. Empty sets: counters 0,
-- bounds NULL. Every aggregate is a function of its own project's rows: an object counts for a
-- building or layout (and a layout for a group) only when both carry the same project_id.

-- name: aggregate_drift_cells()
-- One row per drifted column: entity, id, project_id, column, stored, expected. All values are
-- numeric, compared as numbers (1000 = 1000.00) with NULL-aware IS DISTINCT FROM.
WITH checked_projects AS (
    SELECT id FROM chessboard.projects WHERE status <> 'Archived' AND deleted_at IS NULL
), object_truth AS (
    -- level 3: per project; 1: per (project, building); 2: per (project, layout).
    SELECT po.project_id, po.building_id, po.layout_id,
           GROUPING(po.building_id, po.layout_id) AS level,
           sum(CASE WHEN po.status <> 'Hidden' THEN 1 ELSE 0 END) AS active,
           sum(CASE WHEN po.status = 'Free' THEN 1 ELSE 0 END) AS free,
           min(CASE WHEN po.status = 'Free' THEN po.price END) AS free_price_min,
           max(CASE WHEN po.status = 'Free' THEN po.price END) AS free_price_max
    FROM chessboard.property_objects po
    WHERE po.deleted_at IS NULL
      AND po.project_id IN (SELECT id FROM checked_projects)
    GROUP BY GROUPING SETS ((po.project_id), (po.project_id, po.building_id),
                            (po.project_id, po.layout_id))
), layout_truth AS (
    SELECT l.project_id, l.layout_group_id, count(*) AS live,
           min(l.total_area) AS area_min, max(l.total_area) AS area_max
    FROM chessboard.layouts l
    WHERE l.deleted_at IS NULL AND l.layout_group_id IS NOT NULL
      AND l.project_id IN (SELECT id FROM checked_projects)
    GROUP BY l.project_id, l.layout_group_id
), cells AS (
    SELECT 'project' AS entity, p.id, p.id AS project_id, c.*
    FROM chessboard.projects p
    JOIN checked_projects cp ON cp.id = p.id
    LEFT JOIN object_truth t ON t.level = 3 AND t.project_id = p.id
    CROSS JOIN LATERAL (VALUES
        ('property_objects_total_count', p.property_objects_total_count::numeric,
         coalesce(t.active, 0)::numeric),
        ('property_objects_free_count', p.property_objects_free_count::numeric,
         coalesce(t.free, 0)::numeric),
        ('price_min', p.price_min, t.free_price_min),
        ('price_max', p.price_max, t.free_price_max)
    ) AS c (column_name, stored, expected)
    UNION ALL
    SELECT 'building', b.id, b.project_id, c.*
    FROM chessboard.buildings b
    JOIN checked_projects cp ON cp.id = b.project_id
    LEFT JOIN object_truth t ON t.level = 1 AND t.project_id = b.project_id AND t.building_id = b.id
    CROSS JOIN LATERAL (VALUES
        ('property_objects_total_count', b.property_objects_total_count::numeric,
         coalesce(t.active, 0)::numeric),
        ('property_objects_free_count', b.property_objects_free_count::numeric,
         coalesce(t.free, 0)::numeric)
    ) AS c (column_name, stored, expected)
    UNION ALL
    SELECT 'layout', l.id, l.project_id, c.*
    FROM chessboard.layouts l
    JOIN checked_projects cp ON cp.id = l.project_id
    LEFT JOIN object_truth t ON t.level = 2 AND t.project_id = l.project_id AND t.layout_id = l.id
    CROSS JOIN LATERAL (VALUES
        ('property_objects_count', l.property_objects_count::numeric,
         coalesce(t.active, 0)::numeric)
    ) AS c (column_name, stored, expected)
    UNION ALL
    SELECT 'layout_group', g.id, g.project_id, c.*
    FROM chessboard.layout_groups g
    JOIN checked_projects cp ON cp.id = g.project_id
    LEFT JOIN layout_truth t ON t.project_id = g.project_id AND t.layout_group_id = g.id
    CROSS JOIN LATERAL (VALUES
        ('layouts_count', g.layouts_count::numeric, coalesce(t.live, 0)::numeric),
        ('area_min', g.area_min, t.area_min),
        ('area_max', g.area_max, t.area_max)
    ) AS c (column_name, stored, expected)
)
SELECT entity, id, project_id, column_name AS "column", stored, expected
FROM cells
WHERE stored IS DISTINCT FROM expected;

-- name: aggregate_checked_counts()^
-- How many rows of each entity the check above covered (non-archived projects only).
WITH checked_projects AS (
    SELECT id FROM chessboard.projects WHERE status <> 'Archived' AND deleted_at IS NULL
)
SELECT (SELECT count(*) FROM checked_projects) AS project,
       (SELECT count(*) FROM chessboard.buildings b
         WHERE b.project_id IN (SELECT id FROM checked_projects)) AS building,
       (SELECT count(*) FROM chessboard.layouts l
         WHERE l.project_id IN (SELECT id FROM checked_projects)) AS layout,
       (SELECT count(*) FROM chessboard.layout_groups g
         WHERE g.project_id IN (SELECT id FROM checked_projects)) AS layout_group;

-- name: queue_state(project_ids)
-- Queue rows of drifted projects: a drifted project that is already queued heals on the next
-- drain (a recent edit inside its debounce window); one that is poisoned will not by itself.
SELECT r.project_id, chessboard.recalc_request_poisoned(r, s) AS poisoned
FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
WHERE r.project_id = ANY(:project_ids::uuid[]);

-- name: layout_group_sources()
-- What dim_layout_group should hold for every layout group (archived groups and groups of
-- archived projects included: the dimension keeps them to label old facts, spec 003 INV-DIM-LG-3).
-- The developer is read up the hierarchy, the project's tenant_id (spec 003 INV-DIM-LG-2), not
-- the group's copy of it: a copy gone stale (its triggers bypassed) is then found too.
SELECT g.id, g.project_id, p.tenant_id AS developer_id, g.name, g.sort_order, g.is_archived,
       g.version
FROM chessboard.layout_groups g
JOIN chessboard.projects p ON p.id = g.project_id;

-- name: layout_groups_changed_before(group_ids, seconds)
-- Of the given groups, those whose current version was written more than `seconds` ago (its
-- event went to the outbox in that same transaction): a dimension still behind such a group
-- missed the freshness SLA, it is not merely catching up.
SELECT id
FROM chessboard.layout_groups
WHERE id = ANY(:group_ids::uuid[])
  AND updated_at < now() - make_interval(secs => :seconds);

-- name: lock_project_for_republish(project_id)$
-- The drain locks a project's row before its layout groups (recalc.sql lock order); taking the
-- same lock first makes a re-publish and a drain of one project wait for each other instead of
-- deadlocking on the group rows.
SELECT id FROM chessboard.projects WHERE id = :project_id FOR UPDATE;

-- name: align_layout_group_tenants(group_ids)!
-- Before a re-publish: the given groups whose tenant_id is not their project's take it (the
-- catalogue's triggers keep it so; a write that bypassed them, e.g. with
-- session_replication_role = replica, did not), so the event carries the developer the
-- reconciliation compared against.
UPDATE chessboard.layout_groups g
SET tenant_id = p.tenant_id
FROM chessboard.projects p
WHERE g.id = ANY(:group_ids::uuid[]) AND p.id = g.project_id
  AND g.tenant_id IS DISTINCT FROM p.tenant_id;

-- name: republish_layout_groups(group_ids, floor_versions)$
-- Re-publishes groups to pin.chessboard.layout-group-upserted.v1 so dim_layout_group heals
-- through its normal path (relay → loader). The loader applies an event only when its Version is
-- above the stored SourceVersion, so a re-publish of the same Version would be skipped as stale:
-- each group's version is bumped past both its own and the dimension's (floor_versions; -1 when
-- the row is missing) in the same statement that writes its event. The UPDATE row-locks the
-- group (ordered by id) before the INSERT, so per key the outbox id order is the commit order
-- and the new event is the key's highest Version.
WITH wanted AS (
    SELECT w.id, w.floor_version
    FROM unnest(:group_ids::uuid[], :floor_versions::bigint[]) AS w (id, floor_version)
), locked AS (
    SELECT g.id, w.floor_version
    FROM chessboard.layout_groups g JOIN wanted w ON w.id = g.id
    ORDER BY g.id
    FOR UPDATE OF g
), bumped AS (
    UPDATE chessboard.layout_groups g
    SET version = greatest(g.version, k.floor_version) + 1, updated_at = now(),
        published_snapshot = chessboard.layout_group_snapshot(
            g, g.layouts_count, g.area_min, g.area_max)
    FROM locked k
    WHERE g.id = k.id
    RETURNING g.*
), published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-group-upserted.v1', b.id::text,
           chessboard.layout_group_payload(b)
    FROM bumped b
    ORDER BY b.id
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: clear_events_beyond_source(before)!
-- After a repair re-published every drifted group with a Version above the dimension's (which
-- holds what Kafka held when the drift was read): what the relay's recovery recorded before
-- that read is superseded. A recovery after it stays counted.
UPDATE chessboard.outbox_relay_commits
SET events_beyond_source = 0, beyond_source_since = NULL
WHERE beyond_source_since <= :before;

-- name: clock()$
-- The database's clock: the moment a drift read starts, in the clock the recovery stamps with.
SELECT now();
