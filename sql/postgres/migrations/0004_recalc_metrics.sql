-- depends: 0002_event_payloads
-- Persisted Prometheus counters of the recalc drain and the dimension loader. A drain
-- is a short-lived process, so an in-process counter would reset with every run; these rows are
-- updated in the transaction of the work they count, which makes them exactly-once and
-- restart-proof. `pin metrics serve` reads them at scrape time.

-- Counters are sharded by session (mod(pg_backend_pid(), 16)): two drains committing projects
-- at the same time then update different rows, so the counters never serialize the queue.
-- Readers sum the shards.
CREATE TABLE chessboard.metric_counters (
    -- runs | coalesced_events | republished | duration_sum | duration_bucket
    -- (recalc drain), loader_inserted | loader_skipped_stale (dimension loader)
    metric text NOT NULL,
    -- result (runs), entity (republished), upper bound `le` (duration_bucket), '' otherwise
    label text NOT NULL DEFAULT '',
    shard smallint NOT NULL,
    value double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (metric, label, shard)
);

-- Upper bounds of chessboard_recalc_process_duration_seconds. They are data, not code, so every
-- writer and the exporter agree on them; 2 s is the SLO of spec 000 (p99 < 2 s), so the SLO
-- alert compares against an exact bucket edge. A bucket row counts observations in
-- (previous le, le]; the exporter accumulates them and adds +Inf.
CREATE TABLE chessboard.recalc_duration_buckets (
    le double precision PRIMARY KEY CHECK (le > 0)
);
INSERT INTO chessboard.recalc_duration_buckets (le) VALUES
    (0.005), (0.01), (0.025), (0.05), (0.1), (0.25), (0.5), (1), (2), (5), (10), (30);

-- Worker liveness: one row per drain session shard; the exporter serves the newest tick and the
-- total tick count (a tick with nothing due still counts: the worker is alive).
CREATE TABLE chessboard.recalc_worker_ticks (
    shard smallint PRIMARY KEY,
    ticks bigint NOT NULL DEFAULT 0,
    last_tick_at timestamptz NOT NULL DEFAULT now()
);
