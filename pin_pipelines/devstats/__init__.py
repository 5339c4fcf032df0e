"""dev-stats dimension dim_layout_group (spec 003): Kafka layout-group events → ClickHouse.

`loader.load_once` runs one bounded consume-and-load cycle (CLI and Dagster asset);
`loader.backfill` replays the topic; `dim` holds the
reads (labels, groups, freshness) and the write.
"""
