"""Everything Debian's ClickHouse 18.16 server needs that current ClickHouse does not, in one place.

The DDL in `sql/clickhouse/` targets current ClickHouse; this rewrites it for a server before 20.
Checked on 18.16.1: UUID, Int32/Int64/UInt8, `CREATE DATABASE/TABLE IF NOT EXISTS`,
`ReplacingMergeTree(ver)` with a DateTime version, `ORDER BY` without `PARTITION BY`, argMax and
UUID inserts through clickhouse-driver all work as written. What does not:
- `DateTime64(3)` (code 50, unknown type) → `DateTime`: UpsertedAt keeps whole seconds, so on this
  server two versions of a group stamped within the same second tie in `argMax(…, UpsertedAt)`;
- the MergeTree setting `non_replicated_deduplication_window` (unknown) → dropped, and a migration's
  `ALTER TABLE … MODIFY SETTING` of it (18.16 has no MODIFY SETTING at all) → no statement; the
  server has no `insert_deduplication_token` either (see ServerClickHouse.insert).
"""

from __future__ import annotations

import re

#: The first major version that has DateTime64 and non-replicated insert deduplication.
FIRST_CURRENT_MAJOR = 20

_DATETIME64 = re.compile(r"\bDateTime64\(\s*\d+\s*\)")
_DEDUP_WINDOW = re.compile(r"\s*SETTINGS\s+non_replicated_deduplication_window\s*=\s*\d+", re.I)
_MODIFY_DEDUP_WINDOW = re.compile(
    r"^ALTER\s+TABLE\s+[\w.]+\s+MODIFY\s+SETTING\s+non_replicated_deduplication_window\s*=\s*\d+$",
    re.I,
)


def is_legacy_server(version: tuple[int, ...]) -> bool:
    return version[0] < FIRST_CURRENT_MAJOR


def downgrade_ddl_for_legacy_server(ddl: str) -> str:
    """The same DDL in the dialect of ClickHouse 18.16 (a no-op on DDL that needs no change);
    "" when the statement changes nothing this server has."""
    if _MODIFY_DEDUP_WINDOW.match(ddl.strip()):
        return ""
    return without_non_replicated_dedup_window(_DATETIME64.sub("DateTime", ddl))


def without_non_replicated_dedup_window(ddl: str) -> str:
    """The DDL minus its `non_replicated_deduplication_window` setting: unknown to 18.16, and
    meaningless on a replicated table (which deduplicates through ZooKeeper; cluster.py)."""
    return _DEDUP_WINDOW.sub("", ddl)
