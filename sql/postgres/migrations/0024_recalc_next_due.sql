-- depends: 0023_outbox_notify
-- The seconds until the next queue row is ready, as a function: the scheduler's tick (the
-- 5-second Dagster sensor) records its beat and reads this in ONE statement, one transaction of
-- the catalogue database per tick instead of two (issue 48: 21.8 transactions a second at rest),
-- and the drain's wait for a row due soon reads the same expression.
CREATE FUNCTION chessboard.recalc_next_due_in_seconds() RETURNS float8
LANGUAGE sql STABLE AS $$
    -- <= 0: a row is due now; NULL: nothing but poison is queued. greatest() skips the NULL of
    -- a row never attempted.
    SELECT extract(epoch FROM min(greatest(r.due_at, r.attempted_at + s.retry_interval))
                   - now())::float8
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE r.attempt_count < s.poison_attempts;
$$;
