-- Reads of pin_dev_stats.dim_layout_group. Duplicate-safe before merges: the current row of a group
-- is argMax(…, UpsertedAt) … GROUP BY LayoutGroupId; FINAL is never used online (spec 003).

-- name: stored_versions
-- The loader's version guard: the stored SourceVersion of a batch's groups, in one query.
-- The ids are a UuidSet (pin_pipelines/clickhouse/literals.py): never 1000 parsed UUID literals.
SELECT LayoutGroupId, argMax(SourceVersion, UpsertedAt)
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId;

-- name: labels
-- Names of the actor's groups; a group of another developer is not visible.
SELECT LayoutGroupId, argMax(Name, UpsertedAt)
FROM pin_dev_stats.dim_layout_group
WHERE DeveloperId = %(developer_id)s AND LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId;

-- name: groups
-- The actor's groups in display order, archived ones included (they still label old facts).
SELECT
    LayoutGroupId,
    argMax(ProjectId, UpsertedAt),
    argMax(Name, UpsertedAt),
    argMax(SortOrder, UpsertedAt) AS sort_order,
    argMax(IsArchived, UpsertedAt),
    argMax(SourceVersion, UpsertedAt)
FROM pin_dev_stats.dim_layout_group
WHERE DeveloperId = %(developer_id)s
GROUP BY LayoutGroupId
ORDER BY sort_order, LayoutGroupId;

-- name: current_rows
-- Operator read for the reconciliation: the current row of EVERY group, all developers.
SELECT
    LayoutGroupId,
    argMax(ProjectId, UpsertedAt),
    argMax(DeveloperId, UpsertedAt),
    argMax(Name, UpsertedAt),
    argMax(SortOrder, UpsertedAt),
    argMax(IsArchived, UpsertedAt),
    argMax(SourceVersion, UpsertedAt)
FROM pin_dev_stats.dim_layout_group
GROUP BY LayoutGroupId;
