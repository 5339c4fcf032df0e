-- depends: 0005_outbox_wire_text
-- Recalc attempts are counted when a row is claimed, not when it fails.
--
-- A drain that dies inside a project (OOM kill, segfault, a terminated connection) takes the
-- transaction that would have counted its failure with it. So the claim increments attempt_count
-- in a short transaction of its own, committed before the project's work starts (River and Oban
-- count attempts the same way); a success deletes the row, a caught failure keeps the count, and
-- a drain that is merely interrupted (SIGTERM, a run terminated from the UI) gives the attempt
-- back. A project that crashes its worker every time is thereby parked as poison after
-- poison_attempts claims, like one that fails cleanly.
--
-- attempted_at is when the last attempt started. The retry interval runs from it, never from
-- updated_at: every new edit of the project bumps updated_at, so retries gated on it were
-- postponed for as long as edits kept coming, past the starvation cap.

ALTER TABLE chessboard.project_recalc_requests ADD COLUMN attempted_at timestamptz;
UPDATE chessboard.project_recalc_requests SET attempted_at = updated_at WHERE attempt_count > 0;

-- Rows parked for triage. The row of a project in its last attempt also has attempt_count at
-- the threshold while the attempt runs; the drain holds that row FOR UPDATE, so SKIP LOCKED
-- leaves it out until the attempt has failed (or the worker died). KEY SHARE does not conflict
-- with the enqueue's upsert. Only rows at the threshold are probed, so a long queue is not
-- locked row by row.
CREATE FUNCTION chessboard.poisoned_recalc_requests()
RETURNS SETOF chessboard.project_recalc_requests
LANGUAGE sql VOLATILE AS $$
    SELECT r.*
    FROM chessboard.project_recalc_requests r
    WHERE r.attempt_count >= (SELECT poison_attempts FROM chessboard.recalc_settings)
    FOR KEY SHARE OF r SKIP LOCKED;
$$;
