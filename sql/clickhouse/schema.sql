-- The current definition of the ClickHouse database: what sql/clickhouse/migrations/ builds, in
-- one place, for a reader (a test holds the two equal on every engine: a server migrated from
-- nothing has exactly these tables). Edit it together with each new migration. Targets current
-- ClickHouse; the downgrade for Debian's 18.16 server lives in pin_pipelines/clickhouse/legacy.py.
CREATE DATABASE IF NOT EXISTS pin_dev_stats;

-- dev-stats dimension "layout group" (spec 003): one logical row per LayoutGroupId, the latest
-- UpsertedAt wins at merge. No partitioning (hundreds of rows) and no TTL (archived groups stay).
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
