-- transactional: false
-- depends: 0009_event_trace_context
-- The per-project recompute at 10M property objects (bench/bench_scale.py,
-- docs/capacity.md).
--
-- recalc_buildings and recalc_layouts join each building / layout of the project to its objects
-- on (building_id, project_id) and (layout_id, project_id). With one index per column, the planner
-- answers each of those lookups with a BitmapAnd of the building (or layout) index and the whole
-- project's range of ix_property_objects_project: for a project of 50,000 objects and 100
-- layouts, the project's 50,000 index entries are read once per layout. A table of 250,000 objects
-- hides it (the planner hashes the project's rows instead); at 10,000,000 the recompute of a
-- 10,000-object project took 28 ms of CPU and of a 50,000-object one 85 ms. Indexes on both
-- columns make each lookup one exact index scan: 12.5 ms and 55 ms, as fast as in a catalogue of
-- 1,000 projects. They replace the single-column ones, which they cover as leading column (the
-- foreign keys' cascades from buildings and layouts use them), so writers maintain no more
-- indexes than before.
--
-- Built CONCURRENTLY (hence no transaction): writers are not blocked while a large table is
-- indexed (about 8 s per index at 10M rows on the 2-core machine). A run that stopped half-way
-- left at worst an INVALID index of the same name: each is dropped before it is built.
DROP INDEX CONCURRENTLY IF EXISTS chessboard.ix_property_objects_building_project;
CREATE INDEX CONCURRENTLY ix_property_objects_building_project
    ON chessboard.property_objects (building_id, project_id);
DROP INDEX CONCURRENTLY IF EXISTS chessboard.ix_property_objects_layout_project;
CREATE INDEX CONCURRENTLY ix_property_objects_layout_project
    ON chessboard.property_objects (layout_id, project_id);
DROP INDEX CONCURRENTLY IF EXISTS chessboard.ix_property_objects_building;
DROP INDEX CONCURRENTLY IF EXISTS chessboard.ix_property_objects_layout;

-- JIT compilation is for long analytical queries. The recompute of a big project crosses
-- jit_above_cost once the table is large (the planner prices its bitmap scan of a project's rows
-- as random page reads), and then spends 25-50 ms compiling a statement that runs in 50: at
-- 10,000,000 objects a 50,000-object project took 112-137 ms with JIT and 85-90 ms without, while
-- a 250,000-object catalogue never reaches the threshold. Nothing on this database benefits: the
-- API's statements are small and the reconciliation's full scan stays far below its 60 s goal
-- without it. ALTER DATABASE needs the database's owner (or a superuser); a role that only has
-- CREATE on it leaves JIT on, with a warning that says what to run.
DO $$
BEGIN
    IF pg_has_role(current_user,
                   (SELECT datdba FROM pg_database WHERE datname = current_database()),
                   'USAGE') THEN
        EXECUTE format('ALTER DATABASE %I SET jit = off', current_database());
    ELSE
        RAISE WARNING 'jit stays on for database %: % does not own it. As its owner, run: ALTER DATABASE % SET jit = off',
            current_database(), current_user, quote_ident(current_database());
    END IF;
END
$$;
