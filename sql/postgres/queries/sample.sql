-- Demo data for `pin sample load`: plain inserts through the writers' path, so the raisers
-- (triggers) enqueue every project exactly as production edits would.

-- name: insert_sample_projects(projects)
-- Returns the new projects' ids; each gets 2 buildings, 3 layout groups, 6 layouts and 60 objects.
WITH p AS (
    INSERT INTO chessboard.projects (id, tenant_id, name, status)
    SELECT gen_random_uuid(), gen_random_uuid(), 'Sample project ' || i,
           (ARRAY['Draft', 'Published', 'Hidden'])[1 + mod(i, 3)]
    FROM generate_series(1, :projects) AS i
    RETURNING id
), b AS (
    INSERT INTO chessboard.buildings (id, project_id, name)
    SELECT gen_random_uuid(), p.id, 'Building ' || n FROM p, generate_series(1, 2) AS n
    RETURNING id, project_id
), g AS (
    INSERT INTO chessboard.layout_groups (id, project_id, name, sort_order)
    SELECT gen_random_uuid(), p.id, (ARRAY['Студии', 'Двухкомнатные', 'Люкс с видом на море'])[n], n
    FROM p, generate_series(1, 3) AS n
    RETURNING id, project_id
), l AS (
    INSERT INTO chessboard.layouts (id, project_id, layout_group_id, name, total_area)
    SELECT gen_random_uuid(), g.project_id, g.id, 'Layout ' || n, round((25 + random() * 90)::numeric, 1)
    FROM g, generate_series(1, 2) AS n
    RETURNING id, project_id
), o AS (
    INSERT INTO chessboard.property_objects (id, project_id, building_id, layout_id, status, price)
    SELECT gen_random_uuid(), b.project_id, b.id,
           (SELECT l.id FROM l WHERE l.project_id = b.project_id ORDER BY random() + n LIMIT 1),
           (ARRAY['Free', 'Free', 'Booked', 'Sold', 'Hidden'])[1 + (random() * 4)::int],
           round((3000000 + random() * 20000000)::numeric, 0)
    FROM b, generate_series(1, 30) AS n
    RETURNING 1
)
SELECT id FROM p;
