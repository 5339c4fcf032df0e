"""The two forms of `PIN_CLICKHOUSE_URL`: `chdb:///absolute/dir` and `clickhouse://user:pass@host:port/db`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pin_pipelines.errors import PinError

#: The contract's database; every statement names it, so a connection never depends on it existing.
DATABASE = "pin_dev_stats"
DEFAULT_TCP_PORT = 9000


@dataclass(frozen=True)
class ServerAddress:
    """A ClickHouse server reached over the native protocol (clickhouse-driver)."""

    host: str
    port: int
    user: str
    password: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_clickhouse_url(url: str) -> Path | ServerAddress:
    """The embedded engine's data folder, or the server's address; anything else is a PinError."""
    parts = urlsplit(url)
    if parts.scheme == "chdb":
        path = Path(unquote(parts.netloc + parts.path))
        if not path.is_absolute():
            raise PinError(f"PIN_CLICKHOUSE_URL must be chdb:///absolute/dir, got {url!r}")
        return path
    if parts.scheme == "clickhouse":
        database = parts.path.strip("/")
        if database not in ("", DATABASE):
            raise PinError(
                f"PIN_CLICKHOUSE_URL names database {database!r}; the tables live in {DATABASE!r}"
            )
        try:
            port = parts.port or DEFAULT_TCP_PORT
        except ValueError as exc:
            raise PinError(f"PIN_CLICKHOUSE_URL has a bad port: {url!r}") from exc
        return ServerAddress(
            host=parts.hostname or "127.0.0.1",
            port=port,
            user=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
        )
    raise PinError(
        "PIN_CLICKHOUSE_URL must be chdb:///absolute/dir or clickhouse://user@host:port/db, "
        f"got {url!r}"
    )
