-- depends: 0014_recalc_project_step
-- The three snapshot builders of migration 0008 are STABLE, as their bodies are.
-- Declared IMMUTABLE, they could not be inlined: the planner refuses to inline an IMMUTABLE sql
-- function whose body calls a mutable one, and jsonb_build_object is STABLE. Each call then ran
-- its body as a query of its own (executor start and end per row), and recalc_claimed_project
-- builds a snapshot of every layout, group and project it recomputes, changed or not: 0.08 ms of
-- backend CPU per steady 50-object project, 9 % of it (bench_recalc, measured alone). Inlined,
-- the same jsonb_build_object runs as an expression of the row. Nothing needs them IMMUTABLE:
-- no index or generated column uses them, and their output depends on their arguments only
-- (no timestamptz among them, whose text would follow the session's TimeZone).
ALTER FUNCTION chessboard.project_snapshot(chessboard.projects, int, int, numeric, numeric)
    STABLE;
ALTER FUNCTION chessboard.layout_snapshot(chessboard.layouts, int) STABLE;
ALTER FUNCTION chessboard.layout_group_snapshot(chessboard.layout_groups, int, numeric, numeric)
    STABLE;
