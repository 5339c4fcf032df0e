"""dev-stats dimension dim_layout_group (spec 003): Kafka layout-group events → ClickHouse.

`loader.load_continuously` loads as events come (`pin devstats load`, the Dagster asset's
long-lived runs); `loader.load_once` runs one bounded cycle (`--once`); `loader.backfill` replays
the topic (inserting all of it, or a LayoutGroupId range: replay.py); `dim` holds the reads
(labels, groups, freshness) and the write.
"""
