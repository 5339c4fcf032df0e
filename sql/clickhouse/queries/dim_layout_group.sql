-- Reads of pin_dev_stats.dim_layout_group. Duplicate-safe before merges: the current row of a group
-- is argMax(…, (UpsertedAt, SourceVersion)) … GROUP BY LayoutGroupId; FINAL is never used online
-- (spec 003). UpsertedAt decides; SourceVersion breaks its ties. Ties are routine on Debian's 18.16
-- server, whose UpsertedAt keeps whole seconds (clickhouse/legacy.py), and possible at the
-- millisecond elsewhere: on a tie argMax(…, UpsertedAt) keeps whichever row it read first,
-- typically the OLDEST version. The loader inserts a group's versions in increasing order, so a
-- merge (which keeps the last inserted of equal UpsertedAt) agrees with these reads.

-- name: stored_versions
-- The loader's version guard: the stored SourceVersion of a batch's groups, in one query.
-- The ids are a UuidSet (pin_pipelines/clickhouse/literals.py): never 1000 parsed UUID literals.
SELECT LayoutGroupId, argMax(SourceVersion, (UpsertedAt, SourceVersion))
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId;

-- name: labels
-- Names of the actor's groups; a group of another developer is not visible, nor (when project_id
-- is not NULL) one whose current row is in another project. The developer filters rows (spec 003
-- scope: another developer's rows never enter the read); the project filters the current row, so
-- a group moved out of the project is not labelled with its old name. The ids are a UuidSet too.
SELECT LayoutGroupId, argMax(Name, (UpsertedAt, SourceVersion))
FROM pin_dev_stats.dim_layout_group
WHERE DeveloperId = %(developer_id)s AND LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId
HAVING %(project_id)s IS NULL OR argMax(ProjectId, (UpsertedAt, SourceVersion)) = %(project_id)s;

-- name: groups
-- The actor's groups in display order, archived ones included (they still label old facts);
-- only those of one project when project_id is not NULL (as in labels).
SELECT
    LayoutGroupId,
    argMax(ProjectId, (UpsertedAt, SourceVersion)) AS project_id,
    argMax(Name, (UpsertedAt, SourceVersion)),
    argMax(SortOrder, (UpsertedAt, SourceVersion)) AS sort_order,
    argMax(IsArchived, (UpsertedAt, SourceVersion)),
    argMax(SourceVersion, (UpsertedAt, SourceVersion))
FROM pin_dev_stats.dim_layout_group
WHERE DeveloperId = %(developer_id)s
GROUP BY LayoutGroupId
HAVING %(project_id)s IS NULL OR project_id = %(project_id)s
ORDER BY sort_order, LayoutGroupId;

-- name: current_rows
-- Operator read for the reconciliation: the current row of EVERY group, all developers.
SELECT
    LayoutGroupId,
    argMax(ProjectId, (UpsertedAt, SourceVersion)),
    argMax(DeveloperId, (UpsertedAt, SourceVersion)),
    argMax(Name, (UpsertedAt, SourceVersion)),
    argMax(SortOrder, (UpsertedAt, SourceVersion)),
    argMax(IsArchived, (UpsertedAt, SourceVersion)),
    argMax(SourceVersion, (UpsertedAt, SourceVersion))
FROM pin_dev_stats.dim_layout_group
GROUP BY LayoutGroupId;
