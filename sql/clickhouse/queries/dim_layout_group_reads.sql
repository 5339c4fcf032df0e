-- The online reads of pin_dev_stats.dim_layout_group, each scoped to one developer (spec 003,
-- security: every query filters DeveloperId = the actor): pin_pipelines/devstats/reads.py, which takes
-- an Actor, never a raw developer id. The operator reads are in dim_layout_group.sql.
--
-- The scope, like the project, filters a group's CURRENT row (HAVING argMax(DeveloperId, …)), not
-- its raw rows: a group whose newest version moved it to another developer is no longer the old
-- developer's, merged or not. A WHERE DeveloperId = actor would keep the old row alone in the read
-- until ClickHouse merges, so the old developer would go on getting the group's name.
--
-- Reads of pin_dev_stats.dim_layout_group. Duplicate-safe before merges: the current row of a group
-- is argMax(…, (UpsertedAt, SourceVersion)) … GROUP BY LayoutGroupId; FINAL is never used online
-- (spec 003). UpsertedAt decides; SourceVersion breaks its ties. Ties are routine on Debian's 18.16
-- server, whose UpsertedAt keeps whole seconds (clickhouse/legacy.py), and possible at the
-- millisecond elsewhere: on a tie argMax(…, UpsertedAt) keeps whichever row it read first,
-- typically the OLDEST version. The loader inserts a group's versions in increasing order, so a
-- merge (which keeps the last inserted of equal UpsertedAt) agrees with these reads.
--
-- Each runs on one thread (max_threads = 1): the dimension holds hundreds of groups (spec 003),
-- so a read's cost is ClickHouse's per-query work, and more threads only add to it (measured on
-- the 18.16 server, a labels read of 100 ids: 2.4-2.9 ms of server CPU instead of 3.4-3.7 ms).

-- name: labels
-- Names of the actor's groups; a group whose current row is another developer's is not visible,
-- nor (when project_id is not NULL) one whose current row is in another project, so a group moved
-- away is not labelled with its old name. The ids are a UuidSet too.
SELECT LayoutGroupId AS layout_group_id, argMax(Name, (UpsertedAt, SourceVersion)) AS name
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId
HAVING argMax(DeveloperId, (UpsertedAt, SourceVersion)) = %(developer_id)s
   AND (%(project_id)s IS NULL OR argMax(ProjectId, (UpsertedAt, SourceVersion)) = %(project_id)s)
SETTINGS max_threads = 1;

-- name: groups
-- The actor's groups (their current row the actor's) in display order, archived ones included
-- (they still label old facts); only those of one project when project_id is not NULL (as in
-- labels). Every group is read to find its current row: the dimension holds hundreds (spec 003).
-- Ties of SortOrder go by the id's text: ClickHouse compares UUIDs by their halves in an
-- engine-dependent order, the text is the same everywhere (and what a client sorting ids gets).
SELECT
    LayoutGroupId AS layout_group_id,
    argMax(ProjectId, (UpsertedAt, SourceVersion)) AS project_id,
    argMax(Name, (UpsertedAt, SourceVersion)) AS name,
    argMax(SortOrder, (UpsertedAt, SourceVersion)) AS sort_order,
    argMax(IsArchived, (UpsertedAt, SourceVersion)) AS is_archived,
    argMax(SourceVersion, (UpsertedAt, SourceVersion)) AS source_version
FROM pin_dev_stats.dim_layout_group
GROUP BY LayoutGroupId
HAVING argMax(DeveloperId, (UpsertedAt, SourceVersion)) = %(developer_id)s
   AND (%(project_id)s IS NULL OR project_id = %(project_id)s)
ORDER BY sort_order, toString(LayoutGroupId)
SETTINGS max_threads = 1;

-- name: readable
-- The read API's /healthz: a real read of the dimension (on a cluster, of every shard) that returns
-- no row of anybody's: the nil UUID is never a group's id, so the answer is always 0.
SELECT count()
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId = toUUID('00000000-0000-0000-0000-000000000000')
SETTINGS max_threads = 1;
