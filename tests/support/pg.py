"""libpq URLs in tests: the database a URL names, whatever parameters follow it (a secured
server's sslmode, sslrootcert and passfile)."""

from __future__ import annotations

from urllib.parse import urlsplit


def dbname(dsn: str) -> str:
    """The database of `dsn` (`…/pin_test?sslmode=verify-full` → `pin_test`)."""
    return urlsplit(dsn).path.lstrip("/")
