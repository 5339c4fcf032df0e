-- The operator reads of pin_dev_stats.dim_layout_group, across every developer: the loader's version
-- guard and the reconciliation (pin_pipelines/devstats/dim.py). The developer-scoped online reads are
-- in dim_layout_group_reads.sql (pin_pipelines/devstats/reads.py, reached through an Actor).
--
-- Like the online reads, these take a group's current row by argMax(…, (UpsertedAt, SourceVersion)),
-- never FINAL: dim_layout_group_reads.sql says why.

-- name: stored_versions
-- The loader's version guard: the stored SourceVersion of a batch's groups, in one query.
-- The ids are a UuidSet (pin_pipelines/clickhouse/literals.py): never 1000 parsed UUID literals.
SELECT LayoutGroupId AS layout_group_id,
       argMax(SourceVersion, (UpsertedAt, SourceVersion)) AS source_version
FROM pin_dev_stats.dim_layout_group
WHERE LayoutGroupId IN %(ids)s
GROUP BY LayoutGroupId;

-- name: current_rows
-- Operator read for the reconciliation: the current row of EVERY group, all developers, each
-- compared column under the name the reconciliation reads it by (the dimension's description,
-- pin_pipelines/devstats/dimension.py: tests/unit/test_dimension_description.py keeps them equal).
SELECT
    LayoutGroupId AS id,
    argMax(ProjectId, (UpsertedAt, SourceVersion)) AS project_id,
    argMax(DeveloperId, (UpsertedAt, SourceVersion)) AS developer_id,
    argMax(Name, (UpsertedAt, SourceVersion)) AS name,
    argMax(SortOrder, (UpsertedAt, SourceVersion)) AS sort_order,
    argMax(IsArchived, (UpsertedAt, SourceVersion)) AS is_archived,
    argMax(SourceVersion, (UpsertedAt, SourceVersion)) AS version
FROM pin_dev_stats.dim_layout_group
GROUP BY LayoutGroupId;
