"""The cluster form of the ClickHouse migrations (clickhouse/cluster.py), statement by statement;
tests/integration/test_clickhouse_cluster.py applies it to a real cluster."""

from __future__ import annotations

import pytest

from pin_pipelines.clickhouse.cluster import (
    ClusterStatement,
    column_change,
    created_tables,
    ddl_for_cluster,
    distributed_tables,
)
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server
from pin_pipelines.clickhouse.sqlfiles import (
    CLICKHOUSE_JOURNAL,
    CLICKHOUSE_MIGRATIONS_DIR,
    statements,
)


def sqls(statements: list[ClusterStatement]) -> list[str]:
    return [s.sql for s in statements]


COLUMNS = """(
    LayoutGroupId UUID,
    ProjectId     UUID,
    DeveloperId   UUID,
    Name          String,
    SortOrder     Int32,
    IsArchived    UInt8,
    SourceVersion Int64,
    UpsertedAt    DateTime64(3)
)"""


def test_the_dimension_becomes_a_distributed_table_over_a_replicated_one() -> None:
    """The shipped migration, rewritten for cluster `analytics`: the database ON CLUSTER, then the
    shard-local ReplicatedReplacingMergeTree with the spec's columns and key (its non-replicated
    deduplication setting dropped), then the Distributed table under the spec's name."""
    [database, table] = statements(CLICKHOUSE_MIGRATIONS_DIR / "0001_dim_layout_group.sql")
    assert sqls(ddl_for_cluster(database, "analytics")) == [
        "CREATE DATABASE IF NOT EXISTS pin_dev_stats ON CLUSTER analytics"
    ]
    assert sqls(ddl_for_cluster(table, "analytics")) == [
        "CREATE TABLE IF NOT EXISTS pin_dev_stats.dim_layout_group_local ON CLUSTER analytics\n"
        f"{COLUMNS}\n"
        "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/pin_dev_stats/"
        "dim_layout_group', '{replica}', UpsertedAt)\n"
        "ORDER BY (LayoutGroupId)",
        "CREATE TABLE IF NOT EXISTS pin_dev_stats.dim_layout_group ON CLUSTER analytics\n"
        f"{COLUMNS}\n"
        "ENGINE = Distributed(analytics, pin_dev_stats, dim_layout_group_local, "
        "cityHash64(toString(LayoutGroupId)))",
    ]
    assert distributed_tables(table) == ["pin_dev_stats.dim_layout_group"]
    assert distributed_tables(database) == []
    # What a server must hold for the statement to have run on it (the migration's check).
    assert created_tables(table, "analytics") == [
        "pin_dev_stats.dim_layout_group_local",
        "pin_dev_stats.dim_layout_group",
    ]
    assert created_tables(table, None) == ["pin_dev_stats.dim_layout_group"]
    assert created_tables(database, "analytics") == []


def test_the_legacy_downgrade_applies_to_the_cluster_form_too() -> None:
    """18.16 gets DateTime in both tables; nothing else of the cluster form changes."""
    [_, table] = statements(CLICKHOUSE_MIGRATIONS_DIR / "0001_dim_layout_group.sql")
    for ddl in sqls(ddl_for_cluster(table, "pin")):
        legacy = downgrade_ddl_for_legacy_server(ddl)
        assert "UpsertedAt    DateTime\n" in legacy
        assert legacy == ddl.replace("DateTime64(3)", "DateTime")


def test_an_alter_changes_the_replicas_and_the_distributed_table_in_a_safe_order() -> None:
    """A column added reaches the replicas (ON CLUSTER) before the Distributed table that writes
    go through (server by server: 18.16 refuses ALTER ON CLUSTER of a table that is not
    replicated), a column dropped leaves the Distributed table first; each is skipped on a
    server where the column is added (dropped) already, so a migration cut short runs again. A
    MergeTree setting changes the replicas only (a Distributed table has none)."""
    table = "ALTER TABLE pin_dev_stats.dim_layout_group"
    add = "ADD COLUMN Note String DEFAULT ''"
    assert ddl_for_cluster(f"{table} {add}", "pin") == [
        ClusterStatement(
            f"ALTER TABLE pin_dev_stats.dim_layout_group_local ON CLUSTER pin {add}",
            column=("pin_dev_stats.dim_layout_group_local", "Note", True),
        ),
        ClusterStatement(
            f"{table} {add}",
            every_server=True,
            column=("pin_dev_stats.dim_layout_group", "Note", True),
        ),
    ]
    drop = "DROP COLUMN Note"
    assert ddl_for_cluster(f"{table} {drop}", "pin") == [
        ClusterStatement(
            f"{table} {drop}",
            every_server=True,
            column=("pin_dev_stats.dim_layout_group", "Note", False),
        ),
        ClusterStatement(
            f"ALTER TABLE pin_dev_stats.dim_layout_group_local ON CLUSTER pin {drop}",
            column=("pin_dev_stats.dim_layout_group_local", "Note", False),
        ),
    ]
    setting = "MODIFY SETTING merge_with_ttl_timeout = 3600"
    assert ddl_for_cluster(f"{table} {setting}", "pin") == [
        ClusterStatement(
            f"ALTER TABLE pin_dev_stats.dim_layout_group_local ON CLUSTER pin {setting}"
        )
    ]
    guarded = ddl_for_cluster(f"{table} ADD COLUMN IF NOT EXISTS Note String", "pin")
    assert [s.column for s in guarded] == [
        ("pin_dev_stats.dim_layout_group_local", "Note", True),
        ("pin_dev_stats.dim_layout_group", "Note", True),
    ]
    assert column_change(f"{table} DROP COLUMN IF EXISTS Note") == (
        "pin_dev_stats.dim_layout_group",
        "Note",
        False,
    )
    assert column_change("CREATE DATABASE IF NOT EXISTS pin_dev_stats") is None
    modify = "MODIFY COLUMN Name String DEFAULT ''"
    assert [(s.every_server, s.column) for s in ddl_for_cluster(f"{table} {modify}", "pin")] == [
        (False, None),
        (True, None),
    ]


def test_the_journal_is_one_table_for_the_whole_cluster() -> None:
    """The journal takes the tables' cluster form: replicated per shard, read and written
    through a Distributed table, so every server reads the same migrations as applied."""
    [database, journal] = statements(CLICKHOUSE_JOURNAL)
    assert sqls(ddl_for_cluster(database, "pin")) == [f"{database} ON CLUSTER pin"]
    local, distributed = sqls(ddl_for_cluster(journal, "pin"))
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/pin_dev_stats/" in local
    assert distributed.endswith(
        "ENGINE = Distributed(pin, pin_dev_stats, schema_migrations_local, "
        "cityHash64(toString(Version)))"
    )


def test_a_statement_without_a_cluster_form_is_refused() -> None:
    """A later migration (a mutation, a key of two columns) must be given its cluster form
    before it runs on a cluster, rather than reach one server only."""
    for statement in (
        "ALTER TABLE pin_dev_stats.dim_layout_group UPDATE Name = '' WHERE 1",
        "CREATE TABLE pin_dev_stats.t (a UInt8, b UInt8) ENGINE = MergeTree() ORDER BY (a, b)",
    ):
        with pytest.raises(ValueError, match="no cluster form"):
            ddl_for_cluster(statement, "pin")
