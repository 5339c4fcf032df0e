-- The operator reads of pin_dev_stats.dim_layout_group, across every developer: the loader's version
-- guard and the reconciliation (pin_pipelines/devstats/dim.py). The developer-scoped online reads are
-- in dim_layout_group_reads.sql (pin_pipelines/devstats/reads.py, reached through an Actor).
--
-- Like the online reads, these take a group's current row by argMax(…, (UpsertedAt, SourceVersion)),
-- never FINAL: dim_layout_group_reads.sql says why.

-- name: stored_versions
-- The loader's version guard: the stored SourceVersion of a batch's groups, in one query.
-- The ids are a UuidSet (pin_pipelines/clickhouse/literals.py): never 1000 parsed UUID literals.
SELECT LayoutGroupId, argMax(SourceVersion, (UpsertedAt, SourceVersion))
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId;

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
