"""ClickHouse migrations (clickhouse/migrate.py) on the embedded engine and Debian's 18.16 server:
the migrations build exactly the current definition (`sql/clickhouse/schema.sql`), the journal
applies each file once and refuses one edited after it ran, and a new migration (a column with a
default and a setting changed) is applied while a continuous loader writes, losing nothing.
The cluster form of the same is in test_clickhouse_cluster.py.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import ClickHouse, migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.migrate import journal
from pin_pipelines.clickhouse.sqlfiles import (
    CLICKHOUSE_MIGRATIONS_DIR,
    CLICKHOUSE_SCHEMA,
    statements,
)
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.errors import PinError
from tests.support.clickhouse import server_url
from tests.support.clickhouse_migrations import ADD_NOTE, migrate_while_loading, with_migration
from tests.support.loaders import loader_env

DATABASE = "pin_dev_stats"


def definition(ch: ClickHouse, database: str) -> dict[str, object]:
    """What a database holds, but the journal: each table's engine (its own database's name
    taken out) and columns with their types and defaults, in order (DESCRIBE: 18.16's
    system.columns has no position)."""
    tables = ch.rows(
        "SELECT name, engine_full FROM system.tables "
        "WHERE database = %(db)s AND name != 'schema_migrations' ORDER BY name",
        {"db": database},
    )
    return {
        str(name): (
            str(engine).replace(database, "<db>"),
            [tuple(c[:4]) for c in ch.rows(f"DESCRIBE TABLE {database}.{name}")],
        )
        for name, engine in tables
    }


def test_the_migrations_build_the_current_definition(clickhouse: ClickHouse) -> None:
    """Tried: the current definition created in a database of its own (this server's dialect)
    beside the one the migrations built. Same tables, engines, sorting keys, settings, columns,
    types and defaults: schema.sql says what the migrations do."""
    legacy = is_legacy_server(clickhouse.server_version)
    scratch = f"pin_schema_{uuid.uuid4().hex[:8]}"
    try:
        for statement in statements(CLICKHOUSE_SCHEMA):
            ddl = downgrade_ddl_for_legacy_server(statement) if legacy else statement
            clickhouse.command(
                ddl.replace(f"{DATABASE}.", f"{scratch}.").replace(
                    f"DATABASE IF NOT EXISTS {DATABASE}", f"DATABASE IF NOT EXISTS {scratch}"
                )
            )
        built, current = definition(clickhouse, DATABASE), definition(clickhouse, scratch)
    finally:
        clickhouse.command(f"DROP DATABASE IF EXISTS {scratch}")
    assert built, "the migrated database has no table"
    assert built == current


def test_the_journal_applies_each_migration_once_and_refuses_one_edited_after_it_ran(
    clickhouse: ClickHouse, tmp_path: Path
) -> None:
    """Tried: migrating again, then with the first migration's text edited (a comment added).
    The re-run applies nothing; the edited file stops the migration in one line naming it."""
    assert migrate_clickhouse(clickhouse) == []
    assert set(journal(clickhouse)) >= {"0001_dim_layout_group"}
    edited = tmp_path / "migrations"
    shutil.copytree(CLICKHOUSE_MIGRATIONS_DIR, edited)
    first = edited / "0001_dim_layout_group.sql"
    first.write_text(first.read_text() + "-- edited after it ran\n")
    with pytest.raises(PinError) as refused:
        migrate_clickhouse(clickhouse, migrations=edited)
    message = str(refused.value)
    assert message.startswith("ClickHouse migration 0001_dim_layout_group was changed after it")
    assert "\n" not in message


@pytest.fixture(params=["embedded", "server"])
def private_clickhouse_url(request: pytest.FixtureRequest) -> str:
    """A migrated ClickHouse of this test alone: a new embedded folder (`pin db migrate`), or a
    Debian server of its own."""
    if request.param == "embedded":
        return str(request.getfixturevalue("chdb_folder_url"))
    url = server_url(request.getfixturevalue("private_clickhouse_server"))
    with open_clickhouse(url) as ch:
        migrate_clickhouse(ch)
    return url


def test_a_column_and_a_setting_are_added_while_the_loader_writes(
    private_clickhouse_url: str,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a continuous `pin devstats load` process loading 300 groups' versions 1–10 in
    three waves, and a new migration (a column with a default and a setting changed, from a
    temporary folder) applied while the second wave loads (on the embedded engine through the
    loader, which owns the folder). Every group ends at version 10 and nothing is
    dead-lettered; the column is there with its default on every row, the setting changed
    (current ClickHouse; 18.16 has no such setting), and the journal holds the migration."""
    url = private_clickhouse_url
    migrations = with_migration(tmp_path / "migrations", "0900_layout_group_note", ADD_NOTE)
    env = loader_env(url, kafka_bootstrap, pg_dsn, tmp_path)
    report = migrate_while_loading(
        url, None, migrations, loader_options, env, kafka_bootstrap, tmp_path, inspect=noted_rows
    )
    assert report["applied"] == ["0900_layout_group_note"]
    assert report["consumed"] == 3000 and report["dead_lettered"] == 0
    journaled, rows, noted, engine, legacy = report["inspected"]
    assert journaled and rows >= 300 and noted == rows
    assert legacy or "non_replicated_deduplication_window = 2000" in engine


def noted_rows(ch: ClickHouse) -> tuple[bool, int, int, str, bool]:
    """Whether the journal holds the note's migration; the dimension's rows, those with the
    note's default, its engine; whether the server is 18.16."""
    [(rows, noted)] = ch.rows(
        "SELECT count(), countIf(Note = 'none') FROM pin_dev_stats.dim_layout_group"
    )
    [(engine,)] = ch.rows(
        "SELECT engine_full FROM system.tables "
        "WHERE database = 'pin_dev_stats' AND name = 'dim_layout_group'"
    )
    journaled = "0900_layout_group_note" in journal(ch)
    return journaled, int(rows), int(noted), str(engine), is_legacy_server(ch.server_version)


def test_a_migration_that_stopped_half_way_runs_again_once_mended(
    clickhouse: ClickHouse, tmp_path: Path
) -> None:
    """Tried: a new migration whose second statement fails (a column of its table that does not
    exist) after its first added a column (ClickHouse DDL is not transactional). The migration
    fails and is not in the journal; mended, it runs again: the column added already is not
    added twice (18.16 has no ADD COLUMN IF NOT EXISTS: it is looked for first), and the
    migration is journaled."""
    table = f"pin_dev_stats.half_way_{uuid.uuid4().hex[:8]}"
    version = f"0900_{table.split('.')[1]}"
    first = f"ALTER TABLE {table} ADD COLUMN Note String DEFAULT 'none';\n"
    broken = with_migration(
        tmp_path / "broken", version, f"{first}ALTER TABLE {table} MODIFY COLUMN Nope String;\n"
    )
    mended = with_migration(
        tmp_path / "mended", version, f"{first}ALTER TABLE {table} ADD COLUMN Tag String;\n"
    )
    clickhouse.command(f"CREATE TABLE {table} (Id UInt8) ENGINE = MergeTree() ORDER BY Id")
    try:
        with pytest.raises(PinError):
            migrate_clickhouse(clickhouse, migrations=broken)
        assert version not in journal(clickhouse)
        assert migrate_clickhouse(clickhouse, migrations=mended) == [version]
        columns = [row[0] for row in clickhouse.rows(f"DESCRIBE TABLE {table}")]
        assert columns == ["Id", "Note", "Tag"]
    finally:
        clickhouse.command(f"DROP TABLE IF EXISTS {table}")
        clickhouse.command(
            f"ALTER TABLE pin_dev_stats.schema_migrations DELETE WHERE Version = '{version}'"
        )
