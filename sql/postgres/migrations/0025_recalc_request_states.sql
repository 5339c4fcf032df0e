-- depends: 0024_recalc_next_due
-- A queue row's states written once (issue 50: the drain's "ready" predicate was written six
-- times, `<` in one place and `<=` in another): poisoned, due, ready, and when it becomes ready.
-- Scalar sql functions of the row, which the planner inlines into the query that calls them,
-- so `r.due_at <= now()` stays an index condition of the claim. The claim, the next-due wait,
-- the poison view, the tick's count, the exporter's gauges and the reconciliation use them.

CREATE FUNCTION chessboard.recalc_request_poisoned(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT r.attempt_count >= s.poison_attempts;
$$;

CREATE FUNCTION chessboard.recalc_request_due(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT r.due_at <= now() AND NOT chessboard.recalc_request_poisoned(r, s);
$$;

CREATE FUNCTION chessboard.recalc_request_ready_at(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT greatest(r.due_at, r.attempted_at + s.retry_interval);
$$;

CREATE FUNCTION chessboard.recalc_request_ready(
    r chessboard.project_recalc_requests, s chessboard.recalc_settings
) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT chessboard.recalc_request_due(r, s) AND r.claimed_at IS NULL
       AND chessboard.recalc_request_ready_at(r, s) <= now();
$$;

CREATE OR REPLACE FUNCTION chessboard.poisoned_recalc_requests()
RETURNS SETOF chessboard.project_recalc_requests
LANGUAGE sql STABLE AS $$
    SELECT r.*
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE chessboard.recalc_request_poisoned(r, s);
$$;

CREATE OR REPLACE FUNCTION chessboard.recalc_next_due_in_seconds() RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT extract(epoch FROM min(chessboard.recalc_request_ready_at(r, s)) - now())::float8
    FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
    WHERE NOT chessboard.recalc_request_poisoned(r, s);
$$;

CREATE OR REPLACE FUNCTION chessboard.claim_due_request(p_attempted uuid[])
RETURNS TABLE (
    project_id uuid, tenant_id uuid, last_reason text, requested_count int, attempt_count int,
    waited_seconds float8, claimed_at timestamptz, previous_attempted_at timestamptz
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH ready AS (
        SELECT r.project_id, r.attempted_at
        FROM chessboard.project_recalc_requests r, chessboard.recalc_settings s
        WHERE chessboard.recalc_request_ready(r, s)
          AND r.project_id <> ALL (coalesce(p_attempted, '{}'))
        ORDER BY r.due_at
        LIMIT 1
        FOR UPDATE OF r SKIP LOCKED
    )
    UPDATE chessboard.project_recalc_requests r
    SET claimed_at = now(), attempted_at = now()
    FROM ready
    WHERE r.project_id = ready.project_id
    RETURNING r.project_id, r.tenant_id, r.last_reason::text, r.requested_count, r.attempt_count,
              extract(epoch FROM now() - r.first_requested_at)::float8,
              r.claimed_at, ready.attempted_at;
END
$$;
