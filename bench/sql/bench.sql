-- Synthetic data for bench/: set-based inserts, fast at millions of rows.

-- name: insert_bench_projects(projects, buildings, layouts, objects)
-- `projects` projects, each with `buildings` buildings, `layouts` layouts (in groups of 5) and
-- `objects` property objects spread over them. Returns the project ids.
WITH p AS (
    INSERT INTO chessboard.projects (id, tenant_id, name, status)
    SELECT gen_random_uuid(), gen_random_uuid(), 'Bench ' || i, 'Published'
    FROM generate_series(1, :projects) AS i
    RETURNING id
), b AS (
    INSERT INTO chessboard.buildings (id, project_id, name)
    SELECT gen_random_uuid(), p.id, 'B' || n FROM p, generate_series(1, :buildings) AS n
    RETURNING id, project_id
), g AS (
    INSERT INTO chessboard.layout_groups (id, project_id, name, sort_order)
    SELECT gen_random_uuid(), p.id, 'G' || n, n
    FROM p, generate_series(1, greatest(1, :layouts / 5)) AS n
    RETURNING id, project_id
), l AS (
    INSERT INTO chessboard.layouts (id, project_id, layout_group_id, name, total_area)
    SELECT gen_random_uuid(), g.project_id, g.id, 'L' || n, 20 + n * 3
    FROM g, generate_series(1, 5) AS n
    RETURNING id, project_id
), bl AS (
    SELECT b.project_id, array_agg(DISTINCT b.id) AS buildings, array_agg(DISTINCT l.id) AS layouts
    FROM b JOIN l USING (project_id) GROUP BY b.project_id
), o AS (
    INSERT INTO chessboard.property_objects (id, project_id, building_id, layout_id, status, price)
    SELECT gen_random_uuid(), bl.project_id,
           bl.buildings[1 + mod(n, cardinality(bl.buildings))],
           bl.layouts[1 + mod(n, cardinality(bl.layouts))],
           (ARRAY['Free', 'Booked', 'Sold', 'Hidden'])[1 + mod(n, 4)],
           1000000 + n
    FROM bl, generate_series(1, :objects) AS n
    RETURNING 1
)
SELECT id FROM p;
