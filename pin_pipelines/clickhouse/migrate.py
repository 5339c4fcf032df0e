"""`pin db migrate` for ClickHouse: apply `sql/clickhouse/*.sql` in name order.

Every file is idempotent (`IF NOT EXISTS`), so no version table is kept: re-applying is the upgrade.
With a cluster (`PIN_CLICKHOUSE_CLUSTER`) each statement is applied in its cluster form
(cluster.py), `ON CLUSTER`, which is as idempotent: a re-run finds every table in place. A
statement that a server which is down cannot run stays in ZooKeeper's DDL queue and runs there
when it is back; the migration sends every statement anyway (each waits DDL_TIMEOUT_SECONDS for
the hosts), so the queue holds the whole migration, in order, and then fails saying so.
"""

from __future__ import annotations

from pin_pipelines.clickhouse.client import ClickHouse, ClickHouseUnavailable
from pin_pipelines.clickhouse.cluster import ddl_for_cluster, distributed_tables
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, statements
from pin_pipelines.errors import PinError

#: How long an ON CLUSTER statement waits for every host to run it (the server's
#: `distributed_ddl_task_timeout`, 180 s by default). Below the client's 60 s receive timeout
#: (server.py): past that the client would give up first and report the server it talks to as
#: unreachable, instead of the server's own answer that some hosts have not run it yet.
DDL_TIMEOUT_SECONDS = 45

#: The server's answer to an ON CLUSTER statement that not every host ran within the timeout.
_DDL_TIMEOUT_CODE = 159


def migrate_clickhouse(
    ch: ClickHouse, cluster: str | None = None, ddl_timeout: int = DDL_TIMEOUT_SECONDS
) -> list[str]:
    """Apply every migration, on `cluster` when given; returns the tables that did not exist
    before on the server `ch` is connected to (none on a re-run)."""
    if cluster is not None:
        _require_cluster(ch, cluster)
    legacy = is_legacy_server(ch.server_version)
    before = _tables(ch)
    queued: list[str] = []
    for path in sorted(CLICKHOUSE_SQL_DIR.glob("*.sql")):
        for statement in statements(path):
            for ddl in [statement] if cluster is None else ddl_for_cluster(statement, cluster):
                if cluster is not None:
                    # Per statement: the driver reconnects after a server error, and a new
                    # connection has the server's default again.
                    ch.command(f"SET distributed_ddl_task_timeout = {int(ddl_timeout)}")
                try:
                    ch.command(downgrade_ddl_for_legacy_server(ddl) if legacy else ddl)
                except ClickHouseUnavailable as exc:
                    if getattr(exc.__cause__, "code", None) != _DDL_TIMEOUT_CODE:
                        raise
                    queued.append(str(exc))  # ran here; queued for the hosts that are down
            if cluster is not None:
                for table in distributed_tables(statement):
                    _require_distributed(ch, table)
    if queued:
        raise PinError(
            f"{len(queued)} ON CLUSTER statement(s) did not run on every server of {cluster} "
            f"within {ddl_timeout} s; they stay queued in ZooKeeper and run on those servers "
            f"when they are back (run `pin db migrate` again then to confirm): {queued[0]}"
        )
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
