"""`pin db migrate` for ClickHouse: apply `sql/clickhouse/*.sql` in name order.

Every file is idempotent (`IF NOT EXISTS`), so no version table is kept: re-applying is the upgrade.
"""

from __future__ import annotations

from pin_pipelines.clickhouse.client import ClickHouse
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, statements


def migrate_clickhouse(ch: ClickHouse) -> list[str]:
    """Apply every migration; returns the tables that did not exist before (none on a re-run)."""
    legacy = is_legacy_server(ch.server_version)
    before = _tables(ch)
    for path in sorted(CLICKHOUSE_SQL_DIR.glob("*.sql")):
        for statement in statements(path):
            ch.command(downgrade_ddl_for_legacy_server(statement) if legacy else statement)
    return sorted(_tables(ch) - before)


def _tables(ch: ClickHouse) -> set[str]:
    rows = ch.rows("SELECT database, name FROM system.tables WHERE database = 'pin_dev_stats'")
    return {f"{database}.{name}" for database, name in rows}
