"""Reading ClickHouse SQL kept as `.sql` files: migration statements and named queries.

Comments are whole lines starting with `--`; statements end with `;`.
"""

from __future__ import annotations

import re
from pathlib import Path

from pin_pipelines.config import SQL_DIR

CLICKHOUSE_SQL_DIR = SQL_DIR / "clickhouse"
#: The versioned migrations, applied in name order; a file's name without `.sql` is its version.
CLICKHOUSE_MIGRATIONS_DIR = CLICKHOUSE_SQL_DIR / "migrations"
#: What the migrations build, in one place (a test holds them equal).
CLICKHOUSE_SCHEMA = CLICKHOUSE_SQL_DIR / "schema.sql"
#: The journal of the migrations applied, created before the first one.
CLICKHOUSE_JOURNAL = CLICKHOUSE_SQL_DIR / "journal.sql"
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def statements(path: Path) -> list[str]:
    """The statements of a migration file, in order."""
    parts = _strip_comments(path.read_text()).split(";")
    return [part.strip() for part in parts if part.strip()]


def named_queries(path: Path) -> dict[str, str]:
    """`-- name: x` blocks of a query file (the aiosql layout), by name."""
    chunks = _NAME.split(path.read_text())
    return {
        name: _strip_comments(body).strip().rstrip(";")
        for name, body in zip(chunks[1::2], chunks[2::2], strict=True)
    }
