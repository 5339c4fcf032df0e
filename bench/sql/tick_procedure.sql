-- A measured lever for issue 27, NOT the product: a whole drain tick in one CALL, a COMMIT per
-- project, running the product's own per-project statement (chessboard.recalc_project_step), so
-- that one round trip serves a tick instead of a project. bench/bench_tick_procedure.py runs it
-- against the product's drain; its docstring lists what this leaves out of the product's
-- guarantees and what building it would take.
CREATE SCHEMA IF NOT EXISTS bench_tick;

-- Up to p_batch projects, each in a transaction of its own: the tick's first claim committed
-- alone (as the drain's claim_due_request), then per project recalc_project_step, which also
-- claims the next one, and a COMMIT. `results`: one array per project (project id, outcome,
-- duration, buildings written, layouts, layout groups and projects published, error, attempt
-- count, requests coalesced, seconds waited), for the client's log lines and spans.
-- p_traceparents[n] is the n-th project's span, chosen by the client before the CALL.
CREATE OR REPLACE PROCEDURE bench_tick.tick(
    p_batch int, p_traceparents text[], p_lock_share float8, INOUT results jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    c record;
    s record;
    n int := 0;
    v_attempted uuid[] := '{}';
BEGIN
    results := '[]';
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT * INTO c FROM chessboard.claim_due_request(v_attempted);
    COMMIT;
    WHILE c.project_id IS NOT NULL LOOP
        n := n + 1;
        SELECT * INTO s FROM chessboard.recalc_project_step(
            c.project_id, c.claimed_at, c.previous_attempted_at, c.requested_count,
            p_traceparents[n], p_lock_share, n < p_batch, v_attempted);
        results := results || jsonb_build_array(jsonb_build_array(
            c.project_id, s.outcome, s.duration_seconds, s.buildings_written,
            s.layouts_published, s.layout_groups_published, s.projects_published, s.error,
            s.attempt_count, c.requested_count, c.waited_seconds));
        IF s.outcome IN ('failed', 'deferred') THEN
            v_attempted := v_attempted || c.project_id;
        END IF;
        COMMIT;
        SELECT s.next_project_id AS project_id, s.next_claimed_at AS claimed_at,
               s.next_previous_attempted_at AS previous_attempted_at,
               s.next_requested_count AS requested_count, s.next_waited_seconds AS waited_seconds
        INTO c;
    END LOOP;
END $$;
