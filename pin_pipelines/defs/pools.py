"""Dagster's concurrency pools of the project's ops (limits in dagster.yaml)."""

#: The embedded ClickHouse engine admits one process per data folder; dagster.yaml limits every
#: pool to one op at a time. The continuous loader is not in it: it owns the folder and answers
#: the others (clickhouse/owner.py). The ops in it (the versions check, the drift asset, the
#: backfill) then go through the loader; while none runs, they take turns instead of one of them
#: finding the folder busy.
CLICKHOUSE_POOL = "clickhouse"
