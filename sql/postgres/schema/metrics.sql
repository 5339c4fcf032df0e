-- Persisted Prometheus counters of the recalc drain and the dimension loader, and the liveness
-- of the drain and its scheduler. A drain is a short-lived process, so an in-process counter
-- would reset with every run; these rows are written in the transaction of the work they count,
-- which makes them exactly-once and restart-proof. `pin metrics serve` reads them at scrape time.

-- Counters are sharded by session (mod(pg_backend_pid(), 16)): two drains committing at the
-- same time update different rows, so the counters never serialize the queue. Readers sum the
-- shards.
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

-- Liveness of the recalc scheduler itself. Drains are launched only while rows are due, so
-- recalc_worker_ticks stands still on a quiet night whether the scheduler is alive or dead. The
-- scheduler (the Dagster sensor's evaluation) beats here on every tick, so "idle and alive" and
-- "dead" differ whatever the queue holds (CHESSBOARD_RECALC_WORKER_DOWN).
CREATE TABLE chessboard.recalc_scheduler_beats (
    scheduler text PRIMARY KEY,
    beats bigint NOT NULL DEFAULT 0,
    last_beat_at timestamptz NOT NULL DEFAULT now()
);

-- ---------------------------------------------------------------------------------------------
-- The drain's counters. A project's outcome is ONE row appended to recalc_outcomes in its work
-- transaction (no index, no conflict: a fraction of an upsert of several metric_counters rows),
-- so a rolled-back project counts nothing and a committed one exactly once; each tick's end
-- folds the committed rows into metric_counters (fold_recalc_outcomes), and the exporter reads
-- both (metric_counter_rows), so a scrape never sees a project twice or not at all.
CREATE TABLE chessboard.recalc_outcomes (
    -- runs_total{result}: counters.RESULT_LABELS' values, which the exporter serves
    result text NOT NULL,
    -- one histogram observation; NULL for "deferred", whose time is lock waiting
    duration float8,
    coalesced int NOT NULL,
    republished_project int NOT NULL,
    republished_layout int NOT NULL,
    republished_layout_group int NOT NULL
);

-- plpgsql, not sql, here and in recalc.sql: a sql function that is not inlined parses and plans
-- its body at every call, a plpgsql one plans each statement once per session.
CREATE FUNCTION chessboard.record_recalc_outcome(
    p_result text, p_duration float8, p_coalesced int, p_project int, p_layout int,
    p_layout_group int
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chessboard.recalc_outcomes
    VALUES (p_result, p_duration, p_coalesced, p_project, p_layout, p_layout_group);
END
$$;

-- Outcome rows as counter increments (metric, label, value), as metric_counters names them:
-- runs{result}, coalesced_events, republished{entity}, duration_sum, duration_bucket{le} (the
-- smallest bucket bound at or above the duration, '+Inf' above them all); zero increments left
-- out.
CREATE FUNCTION chessboard.recalc_outcome_counters(p_rows chessboard.recalc_outcomes[])
RETURNS TABLE (metric text, label text, value float8)
LANGUAGE sql STABLE AS $$
    SELECT 'runs', o.result, count(*)::float8
    FROM unnest(p_rows) o
    GROUP BY o.result
    UNION ALL
    SELECT d.metric, d.label, d.value
    FROM (
        SELECT sum(o.coalesced)::float8 AS coalesced, sum(o.duration) AS duration,
               sum(o.republished_project)::float8 AS project,
               sum(o.republished_layout)::float8 AS layout,
               sum(o.republished_layout_group)::float8 AS layout_group
        FROM unnest(p_rows) o
    ) s,
    LATERAL (VALUES ('coalesced_events', '', s.coalesced), ('duration_sum', '', s.duration),
                    ('republished', 'project', s.project), ('republished', 'layout', s.layout),
                    ('republished', 'layout_group', s.layout_group)) AS d (metric, label, value)
    WHERE d.value <> 0
    UNION ALL
    SELECT 'duration_bucket', coalesce(b.le::text, '+Inf'), count(*)::float8
    FROM unnest(p_rows) o,
    LATERAL (SELECT min(k.le) AS le FROM chessboard.recalc_duration_buckets k
             WHERE k.le >= o.duration) b
    WHERE o.duration IS NOT NULL
    GROUP BY b.le;
$$;

-- A tick's end (counters.record_tick): the committed outcome rows taken and added to this
-- session's shard of metric_counters, in one transaction. Two drains folding at once take
-- disjoint rows (the second waits for the first's DELETE, then passes over what it deleted);
-- rows committed meanwhile wait for the next fold. Upserted in key order: no deadlock.
CREATE FUNCTION chessboard.fold_recalc_outcomes() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_taken chessboard.recalc_outcomes[];
BEGIN
    WITH taken AS (
        DELETE FROM chessboard.recalc_outcomes o RETURNING o.*
    )
    SELECT array_agg(ROW(t.*)::chessboard.recalc_outcomes) INTO v_taken FROM taken t;
    IF v_taken IS NOT NULL THEN
        INSERT INTO chessboard.metric_counters AS c (metric, label, shard, value)
        SELECT n.metric, n.label, mod(pg_backend_pid(), 16), n.value
        FROM chessboard.recalc_outcome_counters(v_taken) n
        ORDER BY n.metric, n.label
        ON CONFLICT (metric, label, shard) DO UPDATE SET value = c.value + excluded.value;
    END IF;
END
$$;

-- What the exporter (and the scale bench) sums: the folded counters and the outcome rows not
-- folded yet, read in one snapshot.
CREATE VIEW chessboard.metric_counter_rows AS
SELECT c.metric, c.label, c.value FROM chessboard.metric_counters c
UNION ALL
SELECT n.metric, n.label, n.value
FROM chessboard.recalc_outcome_counters(
    ARRAY(SELECT o FROM chessboard.recalc_outcomes o)) n;
