-- What the group roles of migration 0019 may do in the chessboard database. `pin db migrate`
-- applies this file after the migrations, on every run and under yoyo's lock
-- (pin_pipelines/migrate.py), rather than ALTER DEFAULT PRIVILEGES: default privileges hold only
-- for objects created by the role that set them (a migrate run by another member of the owner
-- role would create ungranted tables), they cannot tell the reader's few read-only functions
-- from the others, and they are invisible in the schema's files. Re-applied, the grants are
-- explicit here, and every object of every later migration is granted on the next migrate.
-- GRANT takes no lock on a table: running workers are not held up.

-- Nothing of the schema for roles that were not given it; functions and procedures are
-- executable by PUBLIC by default, and run as the caller, so a role without table grants could
-- not use them anyway, but a new SECURITY DEFINER one would be open to all.
REVOKE ALL ON SCHEMA chessboard FROM PUBLIC;
REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA chessboard FROM PUBLIC;

-- CONNECT and TEMPORARY are PUBLIC's by default; granted by name too, in case an administrator
-- revoked them from PUBLIC. Only the database's owner may (see 0010 for the same test).
DO $$
BEGIN
    IF pg_has_role(current_user,
                   (SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE') THEN
        EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO pin_worker, pin_reader',
                       current_database());
    END IF;
END
$$;

-- pin_worker: every command and Dagster run but `pin db migrate`. Rows of every table (the
-- chessboard, the queue, the outbox and the relay's receipts, the counters and settings), the
-- sequences, and every routine (the drain's recalc_tick and its functions, the trigger functions
-- and the snapshots they call, the relay's checks). No CREATE on the schema: no DDL.
GRANT USAGE ON SCHEMA chessboard TO pin_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA chessboard TO pin_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA chessboard TO pin_worker;
GRANT EXECUTE ON ALL ROUTINES IN SCHEMA chessboard TO pin_worker;

-- pin_reader: `pin metrics serve` (sql/postgres/queries/metrics.sql, outbox.sql's backlog and
-- topic_stats). SELECT only, and the read-only functions its queries call: the queue row's
-- states the gauges count (an inlined function is still checked for EXECUTE) and the counters
-- view's fold of the outcome rows.
GRANT USAGE ON SCHEMA chessboard TO pin_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA chessboard TO pin_reader;
-- Granted before migration 0025, when the gauges read the poison view.
REVOKE EXECUTE ON FUNCTION chessboard.poisoned_recalc_requests() FROM pin_reader;
GRANT EXECUTE ON FUNCTION
    chessboard.recalc_request_poisoned(chessboard.project_recalc_requests, chessboard.recalc_settings),
    chessboard.recalc_request_due(chessboard.project_recalc_requests, chessboard.recalc_settings),
    chessboard.recalc_outcome_counters(chessboard.recalc_outcomes[]) TO pin_reader;
