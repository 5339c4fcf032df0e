-- The journal of the ClickHouse migrations applied (sql/clickhouse/migrations/): a row per file,
-- with the SHA-256 of its text, so that a file edited after it ran is refused rather than
-- silently diverging from what the servers hold. `pin db migrate` creates it before the first
-- migration; on a cluster it takes the cluster form of every table (clickhouse/cluster.py), so
-- every server reads one journal.
CREATE DATABASE IF NOT EXISTS pin_dev_stats;

CREATE TABLE IF NOT EXISTS pin_dev_stats.schema_migrations
(
    Version   String,
    Checksum  String,
    AppliedAt DateTime
)
ENGINE = ReplacingMergeTree(AppliedAt)
ORDER BY (Version);
