-- Named queries of the Prometheus exporter (issue 7). Parameters are :named (aiosql).
--
-- Writers (record_*) run inside the transaction of the work they count, so a rolled-back project
-- counts nothing and a committed one counts exactly once, whichever process ran it. Each session
-- writes its own shard (mod(pg_backend_pid(), 16)): concurrent drains do not queue on counter
-- rows. Readers sum the shards at scrape time.

-- name: record_recalc_outcome(result, duration, coalesced, project, layout, layout_group)!
-- One claimed project: runs_total{result}, the events it coalesced, the snapshots it republished
-- per entity and (when duration is not NULL) one histogram observation. Zero increments are not
-- written; the exporter serves every known label with 0 until it is first counted. Rows are
-- upserted in key order, so two sessions sharing a shard cannot deadlock.
INSERT INTO chessboard.metric_counters AS c (metric, label, shard, value)
SELECT d.metric, d.label, mod(pg_backend_pid(), 16), d.value
FROM (VALUES
    ('runs', :result::text, 1::float8),
    ('coalesced_events', '', :coalesced::float8),
    ('republished', 'project', :project::float8),
    ('republished', 'layout', :layout::float8),
    ('republished', 'layout_group', :layout_group::float8),
    ('duration_sum', '', :duration::float8),
    ('duration_bucket',
     coalesce((SELECT min(b.le) FROM chessboard.recalc_duration_buckets b
               WHERE b.le >= :duration::float8)::text, '+Inf'),
     CASE WHEN :duration::float8 IS NULL THEN 0 ELSE 1 END)
) AS d (metric, label, value)
WHERE d.value <> 0
ORDER BY d.metric, d.label
ON CONFLICT (metric, label, shard) DO UPDATE SET value = c.value + excluded.value;

-- name: record_tick()!
-- Worker liveness: every drain tick, even one with nothing due, moves the timestamp.
INSERT INTO chessboard.recalc_worker_ticks AS t (shard, ticks, last_tick_at)
VALUES (mod(pg_backend_pid(), 16), 1, now())
ON CONFLICT (shard) DO UPDATE SET
    ticks = t.ticks + 1, last_tick_at = greatest(t.last_tick_at, excluded.last_tick_at);

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

-- name: queue_gauges()^
-- The queue at scrape time. due_backlog leaves poisoned rows out: they stay due forever by
-- design and have their own alert (CHESSBOARD_RECALC_POISON); counting them here would hold
-- CHESSBOARD_RECALC_BACKLOG on until a person requeues them.
SELECT count(r.project_id) AS depth,
       count(r.project_id) FILTER (
           WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts) AS due_backlog,
       (SELECT count(*) FROM chessboard.poisoned_recalc_requests()) AS poisoned,
       coalesce(extract(epoch FROM now() - min(r.due_at) FILTER (
           WHERE r.due_at <= now() AND r.attempt_count < s.poison_attempts)), 0)::float8
           AS oldest_due_age_seconds
FROM chessboard.recalc_settings s
LEFT JOIN chessboard.project_recalc_requests r ON true;

-- name: counter_totals()
-- Every persisted counter, shards summed: (metric, label, value).
SELECT metric, label, sum(value)::float8 AS value
FROM chessboard.metric_counters
GROUP BY metric, label
ORDER BY metric, label;

-- name: duration_buckets()
-- Upper bounds of the process-duration histogram, ascending (+Inf is implicit).
SELECT le FROM chessboard.recalc_duration_buckets ORDER BY le;

-- name: worker_ticks()^
-- Ticks of every drain session and the newest one (NULL before the first tick).
SELECT coalesce(sum(ticks), 0)::bigint AS ticks,
       extract(epoch FROM max(last_tick_at))::float8 AS last_tick_at
FROM chessboard.recalc_worker_ticks;
