-- dev-stats dimension "layout group" (spec 003): one logical row per LayoutGroupId, the latest
-- UpsertedAt wins at merge. No partitioning (hundreds of rows) and no TTL (archived groups stay).
-- Targets current ClickHouse; the one downgrade for Debian's 18.16 server lives in
-- pin_pipelines/clickhouse/legacy.py.
CREATE DATABASE IF NOT EXISTS pin_dev_stats;

-- non_replicated_deduplication_window makes the loader's insert_deduplication_token effective, so
-- a retried batch insert is stored once. It changes no column, key or engine of the spec.
CREATE TABLE IF NOT EXISTS pin_dev_stats.dim_layout_group
(
    LayoutGroupId UUID,
    ProjectId     UUID,
    DeveloperId   UUID,
    Name          String,
    SortOrder     Int32,
    IsArchived    UInt8,
    SourceVersion Int64,
    UpsertedAt    DateTime64(3)
)
ENGINE = ReplacingMergeTree(UpsertedAt)
ORDER BY (LayoutGroupId)
SETTINGS non_replicated_deduplication_window = 1000;
