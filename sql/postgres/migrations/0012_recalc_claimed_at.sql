-- depends: 0011_recalc_scheduler_beats
-- attempt_count is the number of failed runs, as spec 000 defines it ("Число неуспешных
-- прогонов"), no longer the number of claims. An attempt in progress shows apart, as
-- claimed_at: set by the claim's own committed transaction, cleared by the attempt's outcome
-- (record_failure, release_claim; a success deletes the row). A drain that dies inside the
-- attempt cannot clear it: the next tick finds the claim unlocked past retry_interval and counts
-- it as the failed run it was (settle_abandoned_claims), so a project that kills its drain
-- still ends as poison. While a drain works on a row it holds it FOR UPDATE, which is how an
-- abandoned claim is told from a live one (SKIP LOCKED).
--
-- Rows of drains that died before this migration were counted at their claim already; rows
-- claimed right now by drains of the previous release keep counting that way until they end.
ALTER TABLE chessboard.project_recalc_requests ADD COLUMN claimed_at timestamptz;

-- The tick's settle_abandoned_claims looks only at claimed rows: almost always none.
CREATE INDEX ix_project_recalc_claimed ON chessboard.project_recalc_requests (claimed_at)
    WHERE claimed_at IS NOT NULL;

-- attempt_count now reaches poison_attempts only when a failure is recorded (in the work
-- transaction that ends the attempt) or an abandoned claim is settled, never while an attempt
-- runs: the poison view needs no row lock to leave a last attempt in flight out (migration
-- 0006 took FOR KEY SHARE ... SKIP LOCKED for that), so a reader such as the exporter needs
-- SELECT only.
CREATE OR REPLACE FUNCTION chessboard.poisoned_recalc_requests()
RETURNS SETOF chessboard.project_recalc_requests
LANGUAGE sql STABLE AS $$
    SELECT r.*
    FROM chessboard.project_recalc_requests r
    WHERE r.attempt_count >= (SELECT poison_attempts FROM chessboard.recalc_settings);
$$;
