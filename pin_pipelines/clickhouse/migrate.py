"""`pin db migrate` for ClickHouse: apply `sql/clickhouse/*.sql` in name order.

Every file is idempotent (`IF NOT EXISTS`), so no version table is kept: re-applying is the upgrade.
With a cluster (`PIN_CLICKHOUSE_CLUSTER`) each statement is applied in its cluster form
(cluster.py), `ON CLUSTER`, which is as idempotent: a server that was down runs the queued DDL
when it is back, and a re-run finds every table in place.
"""

from __future__ import annotations

from pin_pipelines.clickhouse.client import ClickHouse
from pin_pipelines.clickhouse.cluster import ddl_for_cluster, distributed_tables
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, statements
from pin_pipelines.errors import PinError


def migrate_clickhouse(ch: ClickHouse, cluster: str | None = None) -> list[str]:
    """Apply every migration, on `cluster` when given; returns the tables that did not exist
    before on the server `ch` is connected to (none on a re-run)."""
    if cluster is not None:
        _require_cluster(ch, cluster)
    legacy = is_legacy_server(ch.server_version)
    before = _tables(ch)
    for path in sorted(CLICKHOUSE_SQL_DIR.glob("*.sql")):
        for statement in statements(path):
            for ddl in [statement] if cluster is None else ddl_for_cluster(statement, cluster):
                ch.command(downgrade_ddl_for_legacy_server(ddl) if legacy else ddl)
            if cluster is not None:
                for table in distributed_tables(statement):
                    _require_distributed(ch, table)
    return sorted(_tables(ch) - before)


def _tables(ch: ClickHouse) -> set[str]:
    rows = ch.rows("SELECT database, name FROM system.tables WHERE database = 'pin_dev_stats'")
    return {f"{database}.{name}" for database, name in rows}


def _require_cluster(ch: ClickHouse, cluster: str) -> None:
    """A cluster unknown to the server would fail every ON CLUSTER statement less clearly."""
    found = ch.rows(
        "SELECT count() FROM system.clusters WHERE cluster = %(cluster)s", {"cluster": cluster}
    )
    if not found[0][0]:
        raise PinError(
            f"PIN_CLICKHOUSE_CLUSTER={cluster}, but ClickHouse at {ch.location} has no such "
            "cluster in its remote_servers (PIN_CLICKHOUSE_URL must name one of its servers)"
        )


def _require_distributed(ch: ClickHouse, table: str) -> None:
    """`IF NOT EXISTS` keeps a table made before the cluster setting was: a single-node table
    under the Distributed table's name would take every write while the cluster stays empty."""
    database, name = table.split(".")
    [(engine,)] = ch.rows(
        "SELECT engine FROM system.tables WHERE database = %(db)s AND name = %(name)s",
        {"db": database, "name": name},
    )
    if engine != "Distributed":
        raise PinError(
            f"{table} on {ch.location} is a {engine} table, not Distributed: it was created "
            "before PIN_CLICKHOUSE_CLUSTER was set; move it aside as docs/runbook.md says "
            "(ClickHouse cluster), then migrate again"
        )
