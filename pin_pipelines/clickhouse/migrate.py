"""`pin db migrate` for ClickHouse: apply `sql/clickhouse/*.sql` in name order.

Every file is idempotent (`IF NOT EXISTS`), so no version table is kept: re-applying is the upgrade.
"""

from __future__ import annotations

from pin_pipelines.clickhouse.client import ClickHouse
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_SQL_DIR, statements


def migrate_clickhouse(ch: ClickHouse) -> list[str]:
    """Apply every migration; returns the file names applied (all of them, every time)."""
    legacy = is_legacy_server(ch.server_version)
    files = sorted(CLICKHOUSE_SQL_DIR.glob("*.sql"))
    for path in files:
        for statement in statements(path):
            ch.command(downgrade_ddl_for_legacy_server(statement) if legacy else statement)
    return [path.name for path in files]
