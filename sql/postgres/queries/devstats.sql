-- Named queries of the dim_layout_group loader (spec 003) in PostgreSQL. Parameters are :named
-- (aiosql).
--
-- Its counters, read by the exporter (metrics.sql). Each session writes its own shard
-- (mod(pg_backend_pid(), 16)), so concurrent loaders do not queue on counter rows.

-- name: record_loader_batch(inserted, skipped_stale)!
-- The dimension loader's ClickHouse outcome per batch (consumed and dead-lettered counts are read
-- from Kafka offsets instead). Not transactional with ClickHouse: written after the batch's
-- offsets are committed, so a crash in between undercounts by at most one batch.
INSERT INTO chessboard.metric_counters AS c (metric, label, shard, value)
SELECT d.metric, '', mod(pg_backend_pid(), 16), d.value
FROM (VALUES ('loader_inserted', :inserted::float8),
             ('loader_skipped_stale', :skipped_stale::float8)) AS d (metric, value)
WHERE d.value <> 0
ORDER BY d.metric
ON CONFLICT (metric, label, shard) DO UPDATE SET value = c.value + excluded.value;
