-- What pin_worker may do in Dagster's storage database (its daemon, webserver, code servers and
-- run workers all run as a login role holding pin_worker). `pin db migrate` applies this after
-- it made Dagster's tables as the owner (pin_pipelines/migrate.py), on every run: a Dagster
-- upgrade's new tables (`dagster instance migrate`, run as the owner too) are granted by the
-- next migrate. Rows only: the tables are the owner's, so no run of Dagster changes the schema.

-- Two migrates of databases sharing one Dagster storage would otherwise GRANT on the same
-- tables at once, and PostgreSQL answers the second "tuple concurrently updated".
SELECT pg_advisory_xact_lock(hashtext('pin dagster storage grants'));

DO $$
BEGIN
    IF pg_has_role(current_user,
                   (SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE') THEN
        EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO pin_worker', current_database());
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO pin_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO pin_worker;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO pin_worker;
