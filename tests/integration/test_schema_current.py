"""sql/postgres/schema/ is what the migrations build: the catalog of schema `chessboard` in a
database migrated from empty (pin_pipelines/migrate.py::migrate_postgres) equals the catalog of
one built from the schema files (apply_schema_files).

Compared, object by object: tables and views with their columns in order (type, nullability,
default, generated expression, identity), constraints, indexes (pg_get_indexdef), functions and
procedures (signature, result, language, volatility, strictness, parallel safety, settings, and
the body with its comments and whitespace left out), triggers (pg_get_triggerdef), view
definitions, sequences, the ACLs of the schema, its relations, columns and functions (as sets
of grants, so the order GRANTs ran in does not matter), the database's settings (jit) and the
rows a migration inserts (settings, topics, buckets, SQLSTATE names). On a mismatch the
assertion names each object and shows both definitions.

Tried, to show a drift is caught (test_drift_is_named): the schema-built database with a
function's body edited, an index dropped, a grant added and a seed row changed, each against
the migrated catalog: each is reported under its own object's name. By hand: editing a function
body in sql/postgres/schema/recalc.sql, or deleting a CREATE INDEX from catalogue.sql, fails
test_schema_files_define_what_the_migrations_build with that object's two definitions."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from pin_pipelines.config import dsn_with_dbname
from pin_pipelines.migrate import PG_SCHEMA, PG_SCHEMA_FILES, apply_schema_files, migrate_postgres
from tests.support.database import TEST_PG_DSN

SCHEMA = "chessboard"


@dataclass(frozen=True)
class Definition:
    """What is compared (`key`) and what a person reads on a mismatch (`shown`)."""

    key: object
    shown: str


Catalog = dict[str, Definition]


def _normalized(body: str) -> str:
    """A function body without its comments, its whitespace runs as one space: comments say why,
    and the schema files may say it better than the migration did; the code must be the same.
    String literals are kept as written."""
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        if body.startswith("--", i):
            i = body.find("\n", i)
            i = n if i < 0 else i
        elif body.startswith("/*", i):
            end = body.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif body[i] == "'":
            end = i + 1
            while end < n:
                if body[end] == "'" and body.startswith("''", end):
                    end += 2
                elif body[end] == "'":
                    break
                else:
                    end += 1
            out.append(body[i : end + 1])
            i = end + 1
        else:
            out.append(body[i])
            i += 1
    return re.sub(r"\s+", " ", "".join(out)).strip()


def _acl(items: list[str] | None) -> frozenset[str]:
    return frozenset(items or ())


#: The kinds whose last compared column is an ACL, compared as a set of grants.
ACL_KINDS = frozenset({"schema", "relation", "routine", "type", "default privileges"})

CATALOG_QUERIES: dict[str, str] = {
    # kind -> rows of (name, key..., shown); the first column names the object
    "schema": """
        SELECT n.nspname, n.nspacl::text[], n.nspname || coalesce(' ' || n.nspacl::text, '')
        FROM pg_namespace n WHERE n.nspname = %(schema)s""",
    "relation": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text, c.reloptions,
               c.relrowsecurity, c.relforcerowsecurity, c.relacl::text[],
               c.relkind::text || ' ' || c.relname || coalesce(' ' || c.relacl::text, '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f', 'c')""",
    "columns": """
        SELECT c.relname,
               array_agg(concat_ws(' ', quote_ident(a.attname),
                   format_type(a.atttypid, a.atttypmod),
                   CASE WHEN a.attnotnull THEN 'NOT NULL' END,
                   CASE WHEN a.attgenerated = 's'
                        THEN 'GENERATED ' || pg_get_expr(d.adbin, d.adrelid)
                        WHEN d.adbin IS NOT NULL
                        THEN 'DEFAULT ' || pg_get_expr(d.adbin, d.adrelid) END,
                   CASE WHEN a.attidentity <> '' THEN 'IDENTITY ' || a.attidentity::text END,
                   'ACL ' || (SELECT string_agg(x, ',' ORDER BY x)
                              FROM unnest(a.attacl::text[]) x))
                   ORDER BY a.attnum),
               NULL
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
        GROUP BY c.relname""",
    "constraint": """
        SELECT cl.relname || '.' || co.conname, co.contype::text, pg_get_constraintdef(co.oid),
               co.condeferrable, co.condeferred,
               cl.relname || ': CONSTRAINT ' || co.conname || ' ' || pg_get_constraintdef(co.oid)
        FROM pg_constraint co JOIN pg_class cl ON cl.oid = co.conrelid
        JOIN pg_namespace n ON n.oid = co.connamespace
        WHERE n.nspname = %(schema)s""",
    "index": """
        SELECT c.relname, pg_get_indexdef(c.oid), pg_get_indexdef(c.oid)
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s""",
    "routine": """
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
               p.prokind::text, pg_get_function_result(p.oid), l.lanname, p.provolatile::text,
               p.proisstrict, p.prosecdef, p.proparallel::text, p.proleakproof, p.proconfig,
               CASE WHEN p.prosqlbody IS NULL THEN p.prosrc ELSE pg_get_functiondef(p.oid) END,
               p.proacl::text[],
               pg_get_functiondef(p.oid) || coalesce(E'\nACL ' || p.proacl::text, '')
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        JOIN pg_language l ON l.oid = p.prolang
        WHERE n.nspname = %(schema)s""",
    "trigger": """
        SELECT c.relname || '.' || t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text,
               pg_get_triggerdef(t.oid, true)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal""",
    "view": """
        SELECT c.relname, pg_get_viewdef(c.oid, true), pg_get_viewdef(c.oid, true)
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('v', 'm')""",
    "sequence": """
        SELECT s.sequencename, s.data_type::text, s.start_value, s.min_value, s.max_value,
               s.increment_by, s.cycle, s.cache_size,
               s.sequencename || ' ' || s.data_type || ' START ' || s.start_value
        FROM pg_sequences s WHERE s.schemaname = %(schema)s""",
    "type": """
        SELECT t.typname, t.typtype::text, format_type(t.typbasetype, t.typtypmod), t.typnotnull,
               t.typdefault, (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder)
                              FROM pg_enum e WHERE e.enumtypid = t.oid),
               t.typacl::text[],
               t.typname || ' ' || t.typtype::text || coalesce(' ' || t.typacl::text, '')
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = %(schema)s AND t.typtype IN ('e', 'd', 'r', 'm')""",
    "policy": """
        SELECT c.relname || '.' || p.polname, p.polcmd::text, p.polpermissive,
               p.polroles::regrole[]::text[], pg_get_expr(p.polqual, p.polrelid),
               pg_get_expr(p.polwithcheck, p.polrelid),
               c.relname || '.' || p.polname || ' USING ' || coalesce(pg_get_expr(p.polqual,
                   p.polrelid), '') || ' WITH CHECK ' || coalesce(pg_get_expr(p.polwithcheck,
                   p.polrelid), '')
        FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s""",
    "default privileges": """
        SELECT pg_get_userbyid(d.defaclrole) || ' ' || d.defaclobjtype::text
                   || coalesce(' IN SCHEMA ' || n.nspname, ''),
               d.defaclacl::text[], d.defaclacl::text
        FROM pg_default_acl d LEFT JOIN pg_namespace n ON n.oid = d.defaclnamespace
        WHERE n.nspname = %(schema)s OR d.defaclnamespace = 0""",
    "database setting": """
        SELECT 'ALTER DATABASE SET', s.setconfig, array_to_string(s.setconfig, ', ')
        FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
        WHERE d.datname = current_database() AND s.setrole = 0""",
}


def _rows_of_tables(conn: psycopg.Connection) -> Catalog:
    """Every table's rows (a migrated empty database holds only what migrations insert)."""
    tables = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind = 'r'",
        (SCHEMA,),
    ).fetchall()
    found: Catalog = {}
    for (table,) in tables:
        rows = conn.execute(
            f"SELECT coalesce(array_agg(to_jsonb(t)::text ORDER BY to_jsonb(t)::text), '{{}}')"
            f" FROM {SCHEMA}.{table} t"  # the generated columns' values are compared too
        ).fetchone()
        values = rows[0] if rows else []
        found[f"rows {table}"] = Definition(tuple(values), "\n".join(values) or "(no rows)")
    return found


def catalog(conn: psycopg.Connection) -> Catalog:
    """Schema `chessboard` as comparable definitions, keyed "<kind> <name>"."""
    found: Catalog = {}
    for kind, query in CATALOG_QUERIES.items():
        for row in conn.execute(query, {"schema": SCHEMA}).fetchall():
            name, *key, shown = row
            if kind == "routine":
                key[9] = _normalized(key[9])
            if kind in ACL_KINDS:
                key[-1] = _acl(key[-1])
            if kind == "columns":
                shown = "\n".join(key[0])
            found[f"{kind} {name}"] = Definition(tuple(key), shown)
    found.update(_rows_of_tables(conn))
    return found


def differences(migrated: Catalog, built: Catalog) -> list[str]:
    """Each object whose definitions differ, named, with both definitions (and where they
    part, when both exist)."""
    out = []
    for name in sorted(migrated.keys() | built.keys()):
        left, right = migrated.get(name), built.get(name)
        if left is None or right is None or left.key != right.key:
            diff = ""
            if left and right:
                lines = difflib.unified_diff(
                    left.shown.splitlines(),
                    right.shown.splitlines(),
                    "migrations",
                    "schema files",
                    n=1,
                    lineterm="",
                )
                diff = "\n  " + "\n  ".join(lines)
            out.append(
                f"{name}{diff}\n  migrations:\n    "
                + (left.shown.replace("\n", "\n    ") if left else "(not defined)")
                + "\n  schema files:\n    "
                + (right.shown.replace("\n", "\n    ") if right else "(not defined)")
            )
    return out


@dataclass(frozen=True)
class Databases:
    migrated: str
    built: str


@pytest.fixture(scope="module")
def databases() -> Iterator[Databases]:
    """Two empty databases of this test run's server, one migrated, one built from the schema
    files; both dropped at the end."""
    base = TEST_PG_DSN.rsplit("/", 1)[1]
    names = (f"{base}_migrated", f"{base}_schema_files")
    admin = dsn_with_dbname(TEST_PG_DSN, "postgres")

    def drop_all() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    drop_all()
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
    try:
        dbs = Databases(*(dsn_with_dbname(TEST_PG_DSN, name) for name in names))
        migrate_postgres(dbs.migrated)
        apply_schema_files(dbs.built)
        yield dbs
    finally:
        drop_all()


def _catalog_of(dsn: str) -> Catalog:
    with psycopg.connect(dsn) as conn:
        return catalog(conn)


def test_schema_files_define_what_the_migrations_build(databases: Databases) -> None:
    """The two catalogs are equal, object by object (see the module's docstring)."""
    migrated = _catalog_of(databases.migrated)
    built = _catalog_of(databases.built)
    assert len(migrated) > 100, sorted(migrated)  # a catalog query that finds nothing is no test
    found = differences(migrated, built)
    assert not found, (
        "sql/postgres/schema/ differs from what the migrations build (a change edits both: a "
        "migration AND the schema file; sql/postgres/schema/README.md):\n\n" + "\n\n".join(found)
    )


DRIFTS = {
    "routine release_claim(p_project_id uuid, p_claimed_at timestamp with time zone,"
    " p_previous_attempted_at timestamp with time zone)": """
        CREATE OR REPLACE FUNCTION chessboard.release_claim(
            p_project_id uuid, p_claimed_at timestamptz, p_previous_attempted_at timestamptz
        ) RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE chessboard.project_recalc_requests r
            SET claimed_at = NULL, attempted_at = p_previous_attempted_at
            WHERE r.project_id = p_project_id;
        END
        $$""",
    "index ix_project_recalc_claimed": "DROP INDEX chessboard.ix_project_recalc_claimed",
    "relation outbox_events": "GRANT SELECT ON chessboard.outbox_events TO PUBLIC",
    "rows recalc_settings": "UPDATE chessboard.recalc_settings SET batch_size = 7",
}


@pytest.mark.parametrize("drift", sorted(DRIFTS), ids=lambda drift: drift.split("(")[0])
def test_drift_is_named(databases: Databases, drift: str) -> None:
    """Each drift, applied to the schema-built database in a transaction rolled back afterwards,
    is reported under its own object's name, with both definitions; nothing else differs. A
    comment or the indentation of a body alone is no drift."""
    migrated = _catalog_of(databases.migrated)
    with psycopg.connect(databases.built) as conn:
        conn.execute(DRIFTS[drift].encode())
        drifted = catalog(conn)
        conn.rollback()
    found = differences(migrated, drifted)
    assert [f.split("\n", 1)[0] for f in found] == [drift], "\n\n".join(found)
    assert "migrations:" in found[0] and "schema files:" in found[0]


def test_grants_compare_as_sets(databases: Databases) -> None:
    """The same grants given in another order are no drift (an ACL lists its grantees in the
    order they were granted), so a GRANT belongs wherever it reads best in the schema files;
    one grant more on one side is (test_drift_is_named)."""
    grants = (
        "GRANT SELECT ON chessboard.projects TO PUBLIC",
        "GRANT SELECT ON chessboard.projects TO pg_read_all_data",
        "GRANT USAGE ON SCHEMA chessboard TO PUBLIC",
        "GRANT USAGE ON SCHEMA chessboard TO pg_read_all_data",
    )
    with psycopg.connect(databases.migrated) as left, psycopg.connect(databases.built) as right:
        for grant in grants:
            left.execute(grant.encode())
        for grant in reversed(grants):
            right.execute(grant.encode())
        found = differences(catalog(left), catalog(right))
        left.rollback()
        right.rollback()
    assert not found, "\n\n".join(found)


def test_comments_and_whitespace_are_no_drift() -> None:
    """The body comparison leaves out comments and whitespace runs, never a string literal."""
    body = "BEGIN -- why\n  x := 'a -- b';  /* note */ y\t:= 1;\nEND"
    assert _normalized(body) == "BEGIN x := 'a -- b'; y := 1; END"
    assert _normalized("x := 'it''s -- kept'") == "x := 'it''s -- kept'"


def test_every_schema_file_is_applied() -> None:
    """apply_schema_files runs every file of sql/postgres/schema/: a new file left out of
    PG_SCHEMA_FILES would define objects no database built from the files has."""
    assert sorted(PG_SCHEMA_FILES) == sorted(p.name for p in PG_SCHEMA.glob("*.sql"))
