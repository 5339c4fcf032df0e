-- depends: 0017_outbox_defect_inlined
-- A drain tick in one CALL, a COMMIT per project. The drain sent a statement per
-- project (recalc_project_step, which also claimed the next one): 1.16 round trips per
-- project, each waking the drain's Python, which on a machine as busy as its cores shares a CPU
-- with a backend and runs cold there (bench_drain_placement: its user CPU doubled). Measured
-- with this procedure's prototype against that drain (bench/bench_tick_procedure.py of commit
-- 35c05bd, alternating, 4 rounds, 1,000 projects × 50 objects): CPU per project (backends' and
-- drains') ×0.58-0.66 steady, ×0.74-0.83 edited and rewrite; projects/s ×1.2-1.8; the
-- scale-out by cost (2 workers / 1) 1.03-1.10 where the drain's was 1.10-1.23 (docs/benchmarks.md).
--
-- Every guarantee of the statement per project stays, because each project still runs
-- recalc_project_step in a transaction of its own: the tick's first claim commits alone before
-- any work (an attempt in progress is visible, and a drain that dies inside the work leaves it
-- to settle_abandoned_claims); each next claim commits with the previous project's work; SKIP
-- LOCKED between drains; the outcome row, the failed run, the published snapshots as before.
-- What the procedure adds:
--
-- * A claiming window: no next project is claimed once p_claim_for has passed since the call
--   started, so the drain still obeys a stop (and its tick budget) between calls; the call lasts
--   at most the window plus the last project. The drain's statement_timeout is therefore the
--   per-project bound plus that window (drain.py).
-- * Each project's work and the next claim run in a block of their own (a subtransaction):
--   - lock_not_available on the claimed row itself (a raiser's upsert of it in flight since the
--     claim's commit) defers that project with its attempt given back, and the tick goes on,
--     as the drain did when the statement raised it;
--   - a cancel ends the call normally, the project in hand rolled back whole and reported with
--     the projects already committed: a stop's cancel (the drain's, after its grace) gives its
--     attempt back ("interrupted": a deploy never counts towards poison); the statement
--     timeout's (the call has run past it: the project is stuck) counts a failed run with its
--     error, so a project that always hangs is poisoned after poison_attempts runs, where
--     before its attempt was counted at the next tick as abandoned. The two are told apart by
--     the call's age, not the message, which the server's locale translates.
--   A cancel landing outside the blocks (between a COMMIT and the next block: a few expressions)
--   still ends the call with the error, as does any other error (the work's own errors are a
--   "failed" outcome inside recalc_project_step; what is left is the server's trouble, e.g. a
--   full disk): the projects committed in the call are then not reported (their work and
--   counters are kept), and a claim in hand is settled as abandoned at the next tick, as for a
--   drain that died.
--
-- `results`: one JSON object per project, in order: the claim (project_id, tenant_id,
-- last_reason, requested_count, attempt_count: failed runs before this attempt, waited_seconds)
-- and what became of it (outcome, started: epoch seconds, duration_seconds, buildings_written,
-- layouts_published, layout_groups_published, projects_published, error, failed_runs).
-- p_traceparents[n] is the n-th project's span, chosen by the drain before the call (the events
-- carry it); NULL when nothing is traced.
CREATE PROCEDURE chessboard.recalc_tick(
    p_batch int, p_claim_for interval, p_attempted uuid[], p_traceparents text[],
    p_lock_share float8, INOUT results jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_claim_until timestamptz := clock_timestamp() + p_claim_for;
    v_timeout interval := nullif(current_setting('statement_timeout'), '0')::interval;
    v_attempted uuid[] := coalesce(p_attempted, '{}');
    v_started timestamptz;
    v_claim record;
    v_next record;
    v_step record;
    v_report jsonb;
    v_claimed_next boolean;
    n int := 0;
BEGIN
    results := '[]';
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT * INTO v_claim FROM chessboard.claim_due_request(v_attempted);
    COMMIT;
    WHILE v_claim.project_id IS NOT NULL LOOP
        n := n + 1;
        v_started := clock_timestamp();
        v_claimed_next := false;
        v_report := NULL;
        BEGIN
            SELECT * INTO v_step FROM chessboard.recalc_project_step(
                v_claim.project_id, v_claim.claimed_at, v_claim.previous_attempted_at,
                v_claim.requested_count, p_traceparents[n], p_lock_share, false, NULL);
            IF v_step.outcome IN ('failed', 'deferred') THEN
                v_attempted := v_attempted || v_claim.project_id;
            END IF;
            IF n < p_batch AND clock_timestamp() < v_claim_until THEN
                SELECT * INTO v_next
                FROM chessboard.claim_due_request(v_attempted || v_claim.project_id);
                v_claimed_next := true;
            END IF;
            v_report := jsonb_build_object(
                'outcome', v_step.outcome, 'duration_seconds', v_step.duration_seconds,
                'buildings_written', v_step.buildings_written,
                'layouts_published', v_step.layouts_published,
                'layout_groups_published', v_step.layout_groups_published,
                'projects_published', v_step.projects_published,
                'error', v_step.error, 'failed_runs', v_step.attempt_count);
        EXCEPTION
            WHEN lock_not_available THEN
                PERFORM chessboard.release_claim(v_claim.project_id, v_claim.claimed_at,
                                                 v_claim.previous_attempted_at);
                PERFORM chessboard.record_recalc_outcome('deferred', NULL, 0, 0, 0, 0);
                v_attempted := v_attempted || v_claim.project_id;
                v_report := jsonb_build_object('outcome', 'deferred');
                IF n < p_batch AND clock_timestamp() < v_claim_until THEN
                    SELECT * INTO v_next FROM chessboard.claim_due_request(v_attempted);
                    v_claimed_next := true;
                END IF;
            WHEN query_canceled THEN
                IF clock_timestamp() - statement_timestamp() >= v_timeout THEN
                    v_report := chessboard.record_recalc_timeout(
                        v_claim.project_id, v_claim.claimed_at, SQLSTATE, SQLERRM,
                        clock_timestamp() - v_started);
                ELSE
                    PERFORM chessboard.release_claim(v_claim.project_id, v_claim.claimed_at,
                                                     v_claim.previous_attempted_at);
                    v_report := jsonb_build_object('outcome', 'interrupted');
                END IF;
        END;
        results := results || jsonb_build_array(
            jsonb_build_object('duration_seconds',
                               extract(epoch FROM clock_timestamp() - v_started))
            || v_report || jsonb_build_object(
            'project_id', v_claim.project_id, 'tenant_id', v_claim.tenant_id,
            'last_reason', v_claim.last_reason, 'requested_count', v_claim.requested_count,
            'attempt_count', v_claim.attempt_count, 'waited_seconds', v_claim.waited_seconds,
            'started', extract(epoch FROM v_started)));
        -- After a cancel the call ends (the statement timeout has fired: nothing would bound
        -- what came next); and with no next claim.
        EXIT WHEN NOT v_claimed_next OR v_report->>'outcome' = 'interrupted'
                  OR v_report ? 'timed_out';
        v_claim := v_next;
        COMMIT;
    END LOOP;
END
$$;

-- A project whose work the statement timeout cancelled: one more failed run with the error, no
-- attempt in progress, and its outcome counted, as recalc_project_step records a failure (the
-- work was rolled back with the block; the claimed row is locked again here). Returns the
-- project's report for recalc_tick's results.
CREATE FUNCTION chessboard.record_recalc_timeout(
    p_project_id uuid, p_claimed_at timestamptz, p_state text, p_message text,
    p_duration interval
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_error text := left(
        coalesce((SELECT n.name FROM chessboard.sqlstate_names n WHERE n.sqlstate = p_state),
                 'SQLSTATE ' || p_state) || ': ' || p_message, 1024);
    v_failed_runs int;
    v_seconds float8 := extract(epoch FROM p_duration);
BEGIN
    UPDATE chessboard.project_recalc_requests r
    SET attempt_count = r.attempt_count + 1, last_error = v_error, claimed_at = NULL,
        updated_at = now()
    WHERE r.project_id = p_project_id AND r.claimed_at = p_claimed_at
    RETURNING r.attempt_count INTO v_failed_runs;
    PERFORM chessboard.record_recalc_outcome('error', v_seconds, 0, 0, 0, 0);
    RETURN jsonb_build_object('outcome', 'failed', 'duration_seconds', v_seconds,
                              'error', v_error, 'failed_runs', v_failed_runs,
                              'timed_out', true);
END
$$;
