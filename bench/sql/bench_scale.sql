-- A skewed synthetic catalogue for bench/bench_scale.py, built set-based in ONE
-- transaction of one session. Parameters are :named (aiosql).
--
-- Why INSERT ... SELECT generate_series: on the 2-core machine it wrote 10,000,000 property
-- objects (ids, references, statuses and prices generated in PostgreSQL) in 20.7 s, while COPY
-- of the same rows took 21.7-25.2 s from a ready-made file (parsing alone) and 50.2 s from
-- Python through psycopg's copy(): generating the rows in the server costs less than parsing them.
--
-- The session runs with session_replication_role = replica (bench_scale.py): no raiser enqueues
-- 100,000 projects, no foreign key is checked row by row (the ids are consistent by construction),
-- and the triggers that copy a project's developer to its groups are off (tenant_id is written).
-- The aggregates and published snapshots are then written set-based exactly as the drain would
-- leave them, so the catalogue starts consistent and quiet (empty queue, empty outbox).
-- bench_scale.py checks that: a drain of forced projects finds nothing to write, and `pin
-- reconcile` finds no drift.

-- name: plan_projects(sizes, counts, filler_projects, filler_objects)!
-- One row per project, in random order (objects are written project by project in this order,
-- so the big projects lie between small ones in the table). `sizes`/`counts`: the tiers of big
-- projects; the filler projects share filler_objects. Buildings, layouts (5 per group) and groups
-- per project follow bench.sql's insert_bench_projects.
CREATE TEMP TABLE bench_plan ON COMMIT DROP AS
WITH sized AS (
    SELECT t.size
    FROM unnest(:sizes::int[], :counts::int[]) AS t (size, n), generate_series(1, t.n)
    UNION ALL
    SELECT :filler_objects::int / :filler_projects::int
           + CASE WHEN i <= mod(:filler_objects::int, :filler_projects::int) THEN 1 ELSE 0 END
    FROM generate_series(1, :filler_projects::int) AS i
), numbered AS (
    SELECT (row_number() OVER (ORDER BY random()))::int AS no, size FROM sized
)
SELECT no, gen_random_uuid() AS id, gen_random_uuid() AS tenant_id,
       (ARRAY['Published', 'Published', 'Draft', 'Hidden'])[1 + mod(no, 4)] AS status,
       size,
       greatest(1, least(20, size / 500)) AS buildings,
       greatest(1, least(20, size / 500)) AS layout_groups
FROM numbered;

-- name: plan_buildings()!
CREATE TEMP TABLE bench_buildings ON COMMIT DROP AS
SELECT p.no, n, gen_random_uuid() AS id
FROM bench_plan p, generate_series(1, p.buildings) AS n;

-- name: plan_layout_groups()!
CREATE TEMP TABLE bench_layout_groups ON COMMIT DROP AS
SELECT p.no, n, gen_random_uuid() AS id
FROM bench_plan p, generate_series(1, p.layout_groups) AS n;

-- name: plan_layouts()!
-- Five layouts per group; every 20th is soft-deleted (it still counts its objects, but not in
-- its group's aggregates).
CREATE TEMP TABLE bench_layouts ON COMMIT DROP AS
SELECT g.no, 5 * (g.n - 1) + k AS n, gen_random_uuid() AS id, g.id AS layout_group_id,
       20 + 3.5 * (5 * (g.n - 1) + k) + mod(g.no, 7) AS total_area,
       mod(5 * (g.n - 1) + k, 20) = 0 AS deleted
FROM bench_layout_groups g, generate_series(1, 5) AS k;

-- name: plan_references()!
-- Each project's building and layout ids as arrays: an object picks its references by position.
CREATE TEMP TABLE bench_references ON COMMIT DROP AS
SELECT p.no, p.id, p.size, b.ids AS buildings, l.ids AS layouts
FROM bench_plan p
JOIN (SELECT no, array_agg(id ORDER BY n) AS ids FROM bench_buildings GROUP BY no) b USING (no)
JOIN (SELECT no, array_agg(id ORDER BY n) AS ids FROM bench_layouts GROUP BY no) l USING (no);

-- name: insert_property_objects()!
-- Statuses cycle through all six (Free most often), every 37th object is soft-deleted and every
-- 97th has no layout, so every predicate of the aggregates matters.
INSERT INTO chessboard.property_objects
    (id, project_id, building_id, layout_id, status, price, deleted_at)
SELECT gen_random_uuid(), r.id,
       r.buildings[1 + mod(k, cardinality(r.buildings))],
       CASE WHEN mod(k, 97) <> 96 THEN r.layouts[1 + mod(k, cardinality(r.layouts))] END,
       (ARRAY['Free', 'Free', 'Free', 'Booked', 'Sold', 'Hidden', 'Reserved'])[1 + mod(k + r.no, 7)],
       1000000 + mod(k::bigint * 7919 + r.no::bigint * 104729, 20000000),
       CASE WHEN mod(k, 37) = 36 THEN now() END
FROM bench_references r, generate_series(0, r.size - 1) AS k;

-- name: aggregate_objects()!
-- The aggregates of spec 000 step 4 over every object once: level 3 per project, 1 per
-- (project, building), 2 per (project, layout).
CREATE TEMP TABLE bench_truth ON COMMIT DROP AS
SELECT po.project_id, po.building_id, po.layout_id,
       GROUPING(po.building_id, po.layout_id) AS level,
       (count(*) FILTER (WHERE po.status <> 'Hidden'))::int AS active,
       (count(*) FILTER (WHERE po.status = 'Free'))::int AS free,
       min(po.price) FILTER (WHERE po.status = 'Free') AS price_min,
       max(po.price) FILTER (WHERE po.status = 'Free') AS price_max
FROM chessboard.property_objects po
WHERE po.deleted_at IS NULL
GROUP BY GROUPING SETS ((po.project_id), (po.project_id, po.building_id),
                        (po.project_id, po.layout_id));

-- name: insert_projects()!
INSERT INTO chessboard.projects
    (id, tenant_id, name, status, price_min, price_max, property_objects_total_count,
     property_objects_free_count)
SELECT p.id, p.tenant_id, 'Bench ' || p.no, p.status, t.price_min, t.price_max,
       coalesce(t.active, 0), coalesce(t.free, 0)
FROM bench_plan p
LEFT JOIN bench_truth t ON t.level = 3 AND t.project_id = p.id;

-- name: insert_buildings()!
INSERT INTO chessboard.buildings
    (id, project_id, name, property_objects_total_count, property_objects_free_count)
SELECT b.id, p.id, 'B' || b.n, coalesce(t.active, 0), coalesce(t.free, 0)
FROM bench_buildings b
JOIN bench_plan p USING (no)
LEFT JOIN bench_truth t ON t.level = 1 AND t.building_id = b.id;

-- name: insert_layout_groups()!
INSERT INTO chessboard.layout_groups
    (id, project_id, tenant_id, name, sort_order, layouts_count, area_min, area_max)
SELECT g.id, p.id, p.tenant_id, 'G' || g.n, g.n,
       count(*) FILTER (WHERE NOT l.deleted),
       min(l.total_area) FILTER (WHERE NOT l.deleted),
       max(l.total_area) FILTER (WHERE NOT l.deleted)
FROM bench_layout_groups g
JOIN bench_plan p USING (no)
JOIN bench_layouts l ON l.layout_group_id = g.id
GROUP BY g.id, p.id, p.tenant_id, g.n;

-- name: insert_layouts()!
INSERT INTO chessboard.layouts
    (id, project_id, layout_group_id, name, total_area, deleted_at, property_objects_count)
SELECT l.id, p.id, l.layout_group_id, 'L' || l.n, l.total_area,
       CASE WHEN l.deleted THEN now() END, coalesce(t.active, 0)
FROM bench_layouts l
JOIN bench_plan p USING (no)
LEFT JOIN bench_truth t ON t.level = 2 AND t.layout_id = l.id;

-- The snapshots each row last published, from the same functions the drain compares with: the
-- drain then finds every row already published.

-- name: publish_project_snapshots()!
UPDATE chessboard.projects p
SET published_snapshot = chessboard.project_snapshot(
    p, p.property_objects_total_count, p.property_objects_free_count, p.price_min, p.price_max);

-- name: publish_layout_snapshots()!
UPDATE chessboard.layouts l
SET published_snapshot = chessboard.layout_snapshot(l, l.property_objects_count);

-- name: publish_layout_group_snapshots()!
UPDATE chessboard.layout_groups g
SET published_snapshot = chessboard.layout_group_snapshot(g, g.layouts_count, g.area_min, g.area_max);

-- name: index_definitions(table_name)
-- A table's indexes, each with the statement that creates it again: ADD CONSTRAINT for a primary
-- key or unique constraint, the index definition otherwise. The loader drops them for the bulk
-- insert and builds them after it (a sorted build instead of 10M random inserts per index).
SELECT i.indexrelid::regclass::text AS index_name, c.conname,
       CASE WHEN c.conname IS NULL THEN pg_get_indexdef(i.indexrelid)
            ELSE pg_get_constraintdef(c.oid) END AS definition
FROM pg_index i
LEFT JOIN pg_constraint c ON c.conindid = i.indexrelid AND c.conrelid = i.indrelid
WHERE i.indrelid = :table_name::regclass
ORDER BY 1;

-- name: size_classes()
-- Projects by object count, in random order: the classes the measures sample.
SELECT p.id, count(po.id) AS objects
FROM chessboard.projects p
JOIN chessboard.property_objects po ON po.project_id = p.id
GROUP BY p.id
ORDER BY random();

-- name: edit_one_object_each(project_ids)!
-- A real change in each project: one live object becomes Free, or Booked when it is Free (the
-- free count moves, so the recompute writes the project and publishes it). One statement: the
-- raiser enqueues every project once.
UPDATE chessboard.property_objects po
SET status = CASE po.status WHEN 'Free' THEN 'Booked' ELSE 'Free' END
FROM (
    SELECT DISTINCT ON (project_id) id
    FROM chessboard.property_objects
    WHERE project_id = ANY(:project_ids::uuid[]) AND deleted_at IS NULL
    ORDER BY project_id, id
) pick
WHERE po.id = pick.id;

-- name: make_due(project_ids)!
UPDATE chessboard.project_recalc_requests SET due_at = now()
WHERE project_id = ANY(:project_ids::uuid[]);

-- name: force_due(project_ids)!
-- Queue rows due now without any change: the drain then has nothing to write.
INSERT INTO chessboard.project_recalc_requests AS r
    (project_id, tenant_id, due_at, first_requested_at, last_reason)
SELECT id, tenant_id, now(), now(), 'Manual' FROM chessboard.projects
WHERE id = ANY(:project_ids::uuid[])
ON CONFLICT (project_id) DO UPDATE SET due_at = now();

-- name: publish_all_layout_groups()$
-- Every group's snapshot event into the outbox, as the reconciliation's repair writes it: the
-- events the relay and the loader are measured on, and what fills the dimension.
WITH published AS (
    INSERT INTO chessboard.outbox_events (topic, message_key, payload)
    SELECT 'pin.chessboard.layout-group-upserted.v1', g.id::text,
           chessboard.layout_group_payload(g)
    FROM chessboard.layout_groups g
    RETURNING 1
)
SELECT count(*) FROM published;

-- name: edit_pool(percent)
-- Free live objects for the edit load, a random sample of about `percent` % of all objects: each
-- is sold or withdrawn once, so every edit lowers its project's free count.
SELECT id, project_id
FROM chessboard.property_objects TABLESAMPLE BERNOULLI (:percent)
WHERE status = 'Free' AND deleted_at IS NULL;

-- name: relation_sizes(tables)
-- Per relation: heap, indexes and total (TOAST included) in bytes, with its churn counters.
SELECT c.relname, pg_relation_size(c.oid) AS heap_bytes, pg_indexes_size(c.oid) AS index_bytes,
       pg_total_relation_size(c.oid) AS total_bytes, s.n_live_tup, s.n_dead_tup,
       s.autovacuum_count, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del
FROM pg_class c
JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = ANY(:tables::regclass[])
ORDER BY c.relname;

-- name: index_sizes(tables)
SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
FROM pg_index i
WHERE i.indrelid = ANY(:tables::regclass[])
ORDER BY 1;

-- name: pipeline_counts()^
-- Queue rows (all, due), outbox rows, and the drain's persisted counters (sums over shards).
SELECT (SELECT count(*) FROM chessboard.project_recalc_requests) AS queued,
       (SELECT count(*) FROM chessboard.project_recalc_requests WHERE due_at <= now()) AS due,
       (SELECT count(*) FROM chessboard.outbox_events) AS outbox,
       (SELECT coalesce(sum(value), 0) FROM chessboard.metric_counter_rows
        WHERE metric = 'runs' AND label = 'success') AS recalculated,
       (SELECT coalesce(sum(value), 0) FROM chessboard.metric_counter_rows
        WHERE metric = 'duration_sum') AS recalc_seconds,
       (SELECT coalesce(sum(published), 0) FROM chessboard.outbox_topic_stats) AS relayed;

-- name: database_activity(names)
-- Per database: sessions opened and milliseconds spent executing statements, from the server's
-- own counters. They include the backends too short-lived for bench/_cpu.py's sampling (a
-- connection per operation, as Dagster's storage and every sensor tick open).
SELECT datname, sessions, active_time FROM pg_stat_database WHERE datname = ANY(:names);
