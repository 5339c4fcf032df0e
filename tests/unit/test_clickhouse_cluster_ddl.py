"""The cluster form of the ClickHouse migrations (clickhouse/cluster.py), statement by statement;
tests/integration/test_clickhouse_cluster.py applies it to a real cluster."""

from __future__ import annotations

import pytest

from pin_pipelines.clickhouse.cluster import ddl_for_cluster, distributed_tables
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, statements

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
    [database, table] = statements(CLICKHOUSE_SQL_DIR / "0001_dim_layout_group.sql")
    assert ddl_for_cluster(database, "analytics") == [
        "CREATE DATABASE IF NOT EXISTS pin_dev_stats ON CLUSTER analytics"
    ]
    assert ddl_for_cluster(table, "analytics") == [
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


def test_the_legacy_downgrade_applies_to_the_cluster_form_too() -> None:
    """18.16 gets DateTime in both tables; nothing else of the cluster form changes."""
    [_, table] = statements(CLICKHOUSE_SQL_DIR / "0001_dim_layout_group.sql")
    for ddl in ddl_for_cluster(table, "pin"):
        legacy = downgrade_ddl_for_legacy_server(ddl)
        assert "UpsertedAt    DateTime\n" in legacy
        assert legacy == ddl.replace("DateTime64(3)", "DateTime")


def test_a_statement_without_a_cluster_form_is_refused() -> None:
    """A later migration (an ALTER, a key of two columns) must be given its cluster form before
    it runs on a cluster, rather than reach one server only."""
    for statement in (
        "ALTER TABLE pin_dev_stats.dim_layout_group ADD COLUMN Extra String",
        "CREATE TABLE pin_dev_stats.t (a UInt8, b UInt8) ENGINE = MergeTree() ORDER BY (a, b)",
    ):
        with pytest.raises(ValueError, match="no cluster form"):
            ddl_for_cluster(statement, "pin")
