-- depends: 0018_recalc_tick
-- Least privilege (CONTRACT section 8): the group roles every other process runs as, so that
-- only `pin db migrate` runs as the schema's owner. pin_worker: every command and Dagster run
-- but migrate (the chessboard's rows, the queue, the outbox, the counters; no DDL); pin_reader:
-- `pin metrics serve` (SELECT only). NOLOGIN: an administrator grants them to login roles.
--
-- Roles belong to the cluster, not to this database: created where missing, so a second
-- database on the same server (and a concurrent migrate of it) finds them made. Creating one
-- needs CREATEROLE (or a superuser); an administrator may create both beforehand instead, and
-- then the owner needs no CREATEROLE. What they are granted is not here but in grants.sql,
-- which `pin db migrate` applies after every run (pin_pipelines/migrate.py), so tables and
-- functions of later migrations are granted too.
DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['pin_worker', 'pin_reader'] LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role);
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- a concurrent migrate of another database made it meanwhile
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'role % is missing and % may not create it: run `pin db migrate` as a role with CREATEROLE, or have an administrator run CREATE ROLE % NOLOGIN',
                    v_role, current_user, v_role;
        END;
    END LOOP;
END
$$;

-- Before PostgreSQL 15 every role may create objects in schema public (PostgreSQL 15 revoked it):
-- a worker could then make tables there. Only the schema's owner may revoke it; anyone else is
-- told what to run.
DO $$
BEGIN
    IF current_setting('server_version_num')::int < 150000
       AND has_schema_privilege('public', 'public', 'CREATE') THEN
        IF pg_has_role(current_user,
                       (SELECT nspowner FROM pg_namespace WHERE nspname = 'public'), 'USAGE') THEN
            REVOKE CREATE ON SCHEMA public FROM PUBLIC;
        ELSE
            RAISE WARNING 'every role may create objects in schema public of database %: as its owner, run REVOKE CREATE ON SCHEMA public FROM PUBLIC',
                current_database();
        END IF;
    END IF;
END
$$;
