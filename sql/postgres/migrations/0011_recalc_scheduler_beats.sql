-- depends: 0010_recalc_scale_indexes
-- Liveness of the recalc scheduler itself. Drains are launched only while rows are
-- due, so recalc_worker_ticks stands still on a quiet night whether the scheduler is alive or
-- dead. The scheduler (the Dagster sensor's 5-second evaluation) beats here on every tick, so
-- "idle and alive" and "dead" differ whatever the queue holds (CHESSBOARD_RECALC_WORKER_DOWN).
CREATE TABLE chessboard.recalc_scheduler_beats (
    scheduler text PRIMARY KEY,
    beats bigint NOT NULL DEFAULT 0,
    last_beat_at timestamptz NOT NULL DEFAULT now()
);
