"""The forms of `PIN_CLICKHOUSE_URL`: `chdb:///absolute/dir`, `clickhouse://user:pass@host:port/db`
and `clickhouses://…` (the native protocol over TLS, as clickhouse-driver's `Client.from_url`).

TLS takes clickhouse-driver's URL parameters `verify`, `ca_certs`, `certfile`, `keyfile`, and
`secure=true` on `clickhouse://` means `clickhouses://`. Any other parameter is refused: one the
project ignored (a misspelt `verfy=false`, a `secure=true` it did not know) would send a password
in plaintext or trust a server it should not. Every message shows the URL redacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from pin_pipelines.errors import PinError
from pin_pipelines.redact import redact_url

#: The contract's database; every statement names it, so a connection never depends on it existing.
DATABASE = "pin_dev_stats"
DEFAULT_TCP_PORT = 9000
DEFAULT_TLS_PORT = 9440
#: The query parameters a server URL takes (clickhouse-driver's names); file paths or booleans.
TLS_PATH_PARAMS = ("ca_certs", "certfile", "keyfile")
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True)
class ServerAddress:
    """A ClickHouse server reached over the native protocol (clickhouse-driver).

    The password is the URL's, or else read from `password_file` at each connection
    (`current_password`), so a rotated secret counts from the next connection. Neither the
    password nor the file's content is in the repr."""

    host: str
    port: int
    user: str
    password: str = field(repr=False)
    secure: bool = False
    verify: bool = True
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    password_file: Path | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def current_password(self) -> str:
        """The URL's password, else the password file's content without its trailing newline
        (`PIN_CLICKHOUSE_PASSWORD_FILE`, e.g. a Kubernetes secret mounted as a file)."""
        if self.password or self.password_file is None:
            return self.password
        try:
            return self.password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise PinError(
                f"ClickHouse at {self}: cannot read PIN_CLICKHOUSE_PASSWORD_FILE "
                f"{self.password_file}: {exc.strerror or exc}"
            ) from exc


def parse_clickhouse_url(url: str, *, password_file: Path | None = None) -> Path | ServerAddress:
    """The embedded engine's data folder, or the server's address; anything else is a PinError.
    `password_file` (PIN_CLICKHOUSE_PASSWORD_FILE) serves a server URL without a password."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme == "chdb":
        path = Path(unquote(parts.netloc + parts.path))
        if not path.is_absolute():
            raise PinError(f"PIN_CLICKHOUSE_URL must be chdb:///absolute/dir, got {shown!r}")
        return path
    if parts.scheme in ("clickhouse", "clickhouses"):
        database = parts.path.strip("/")
        if database not in ("", DATABASE):
            raise PinError(
                f"PIN_CLICKHOUSE_URL names database {database!r}; the tables live in {DATABASE!r}"
            )
        flags, paths = _params(parts.query, shown)
        secure = parts.scheme == "clickhouses" or flags.get("secure", False)
        tls_only = [name for name in ("verify", *TLS_PATH_PARAMS) if name in {**flags, **paths}]
        if tls_only and not secure:
            raise PinError(
                f"PIN_CLICKHOUSE_URL parameter {tls_only[0]} applies to TLS only: use "
                "clickhouses:// (or secure=true)"
            )
        try:
            port = parts.port or (DEFAULT_TLS_PORT if secure else DEFAULT_TCP_PORT)
        except ValueError as exc:
            raise PinError(f"PIN_CLICKHOUSE_URL has a bad port: {shown!r}") from exc
        return ServerAddress(
            host=parts.hostname or "127.0.0.1",
            port=port,
            user=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            secure=secure,
            verify=flags.get("verify", True),
            ca_certs=paths.get("ca_certs"),
            certfile=paths.get("certfile"),
            keyfile=paths.get("keyfile"),
            password_file=password_file,
        )
    raise PinError(
        "PIN_CLICKHOUSE_URL must be chdb:///absolute/dir or clickhouse://user@host:port/db "
        f"(clickhouses:// over TLS), got {shown!r}"
    )


def _params(query: str, shown: str) -> tuple[dict[str, bool], dict[str, str]]:
    """The URL's parameters: the booleans `secure`/`verify`, and the TLS files' paths."""
    flags: dict[str, bool] = {}
    paths: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in ("secure", "verify"):
            if value.lower() not in _BOOLEANS:
                raise PinError(
                    f"PIN_CLICKHOUSE_URL parameter {name} must be true or false, got {value!r}"
                )
            flags[name] = _BOOLEANS[value.lower()]
        elif name in TLS_PATH_PARAMS:
            if not value:
                raise PinError(f"PIN_CLICKHOUSE_URL parameter {name} needs a file path")
            paths[name] = value
        else:
            raise PinError(
                f"PIN_CLICKHOUSE_URL has an unknown parameter {name!r} (known: secure, verify, "
                f"{', '.join(TLS_PATH_PARAMS)}): {shown}"
            )
    return flags, paths
