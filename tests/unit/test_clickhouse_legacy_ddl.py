"""The one place that adapts the DDL to Debian's ClickHouse 18.16, only for servers before 20."""

from __future__ import annotations

from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_MIGRATIONS_DIR, statements

MIGRATION = CLICKHOUSE_MIGRATIONS_DIR / "0001_dim_layout_group.sql"


def test_only_servers_before_20_are_legacy() -> None:
    assert is_legacy_server((18, 16, 1))
    assert is_legacy_server((19, 17, 4, 11))
    assert not is_legacy_server((20, 1))
    assert not is_legacy_server((26, 9, 2, 1))  # chdb 4.4's engine


def test_the_sql_file_targets_current_clickhouse() -> None:
    create_table = statements(MIGRATION)[1]
    assert "UpsertedAt    DateTime64(3)" in create_table
    assert "ENGINE = ReplacingMergeTree(UpsertedAt)\nORDER BY (LayoutGroupId)" in create_table
    assert "PARTITION BY" not in create_table and "TTL" not in create_table


def test_downgrade_changes_only_datetime64_and_the_dedup_window() -> None:
    """18.16 lacks DateTime64 (code 50) and the non-replicated deduplication setting."""
    create_table = statements(MIGRATION)[1]
    legacy = downgrade_ddl_for_legacy_server(create_table)
    assert legacy == (
        create_table.replace("DateTime64(3)", "DateTime").replace(
            "\nSETTINGS non_replicated_deduplication_window = 1000", ""
        )
    )
    assert "DateTime64" not in legacy and "SETTINGS" not in legacy


def test_downgrade_leaves_statements_without_those_alone() -> None:
    create_database = statements(MIGRATION)[0]
    assert create_database == "CREATE DATABASE IF NOT EXISTS pin_dev_stats"
    assert downgrade_ddl_for_legacy_server(create_database) == create_database


def test_a_change_of_the_dedup_window_is_no_statement_on_18_16() -> None:
    """18.16 has no MODIFY SETTING and no such setting: a migration that changes the window runs
    nothing there (its tables never had it); any other ALTER is left as written."""
    change = "ALTER TABLE pin_dev_stats.dim_layout_group MODIFY SETTING "
    assert (
        downgrade_ddl_for_legacy_server(f"{change}non_replicated_deduplication_window = 2000") == ""
    )
    other = "ALTER TABLE pin_dev_stats.dim_layout_group ADD COLUMN Note String DEFAULT ''"
    assert downgrade_ddl_for_legacy_server(other) == other
