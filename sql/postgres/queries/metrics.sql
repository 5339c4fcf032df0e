-- Named queries of the Prometheus exporter. Parameters are :named (aiosql).
--
-- Read-only, at scrape time. The counters are written by the work they count, in its own
-- transaction (recalc.sql: record_recalc_outcome, record_tick; devstats.sql:
-- record_loader_batch), each session into its own shard; the readers below sum the shards.

-- name: queue_gauges()^
-- The queue at scrape time. due_backlog is spec 000's: every row with due_at < now(), poisoned
-- ones included. due_backlog_unpoisoned leaves those out: they stay due forever by design and
-- have their own alert (CHESSBOARD_RECALC_POISON), so CHESSBOARD_RECALC_BACKLOG watches this one
-- rather than stay on until a person requeues them.
SELECT count(r.project_id) AS depth,
       count(r.project_id) FILTER (WHERE r.due_at < now()) AS due_backlog,
       count(r.project_id) FILTER (WHERE chessboard.recalc_request_due(r, s))
           AS due_backlog_unpoisoned,
       count(r.project_id) FILTER (WHERE chessboard.recalc_request_poisoned(r, s)) AS poisoned,
       coalesce(extract(epoch FROM now() - min(r.due_at) FILTER (
           WHERE chessboard.recalc_request_due(r, s))), 0)::float8
           AS oldest_due_age_seconds
FROM chessboard.recalc_settings s
LEFT JOIN chessboard.project_recalc_requests r ON true;

-- name: counter_totals()
-- Every persisted counter, shards summed, with the drain's outcome rows not folded yet
-- (metric_counter_rows, schema/metrics.sql): (metric, label, value).
SELECT metric, label, sum(value)::float8 AS value
FROM chessboard.metric_counter_rows
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

-- name: scheduler_beats()^
-- Beats of every scheduler and the newest one (NULL before the first beat).
SELECT coalesce(sum(beats), 0)::bigint AS beats,
       extract(epoch FROM max(last_beat_at))::float8 AS last_beat_at
FROM chessboard.recalc_scheduler_beats;
