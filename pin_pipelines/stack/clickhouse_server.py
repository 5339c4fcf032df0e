"""Debian's `clickhouse-server` (18.16) for the native-protocol path, run from the state folder.

Used when `PIN_CLICKHOUSE_URL` is `clickhouse://…` on loopback (the embedded engine needs none).
The package's own config and init scripts are not used: a small `<yandex>` config under
`<state_dir>/clickhouse-server/` keeps data, logs and ports in the project's hands. 18.16 runs as
root without complaint and needs no `users.d`/`config.d`.

Secured (`tls_port`, for `pin stack up --secure` and the tests of CONTRACT section 8): the native
protocol over TLS on `tls_port` with a certificate of the local CA (stack/tls.py), and two users
besides the URL's (the admin, kept on the plaintext loopback port): `writer` (profile default:
the loader's INSERT and SELECT, and on 18.16, which has no grants, `pin db migrate`'s DDL) and
`reader` (`readonly = 2`: SELECT, and the settings every statement sends). 18.16 has no SQL
users, so they live in users.xml; their passwords are generated once into 0600 files of the
folder (`password_file`), which clients read through PIN_CLICKHOUSE_PASSWORD_FILE.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import time
from pathlib import Path
from urllib.parse import quote
from xml.sax.saxutils import escape

from pin_pipelines.clickhouse import DATABASE, ServerAddress, parse_clickhouse_url
from pin_pipelines.clickhouse.server import ServerClickHouse  # see FACE_EXCEPTIONS, test_layering
from pin_pipelines.config import LOOPBACK_HOSTS, Settings
from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import (
    apt_install,
    free_port,
    port_open,
    read_pid,
    start_detached,
    stop_pid,
    wait_until,
)
from pin_pipelines.stack.tls import LocalCA

SERVICE = "clickhouse-server"
PACKAGE = "clickhouse-server"
BINARY = "clickhouse-server"

CONFIG = """\
<?xml version="1.0"?>
<!-- Written by `pin stack up`; edits are overwritten. -->
<yandex>
    <logger>
        <level>information</level>
        <log>{root}/server.log</log>
        <errorlog>{root}/server.err.log</errorlog>
        <size>100M</size>
        <count>3</count>
    </logger>
    <listen_host>127.0.0.1</listen_host>
    <tcp_port>{tcp_port}</tcp_port>
    <http_port>{http_port}</http_port>
    <path>{root}/data/</path>
    <tmp_path>{root}/tmp/</tmp_path>
    <users_config>{root}/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>UTC</timezone>
    <mark_cache_size>268435456</mark_cache_size>
{extra}</yandex>
"""

USERS = """\
<?xml version="1.0"?>
<!-- Written by `pin stack up`: the URL's user and password (and when secured the writer and
     the reader), loopback only. -->
<yandex>
    <profiles><default/><{reader_profile}><readonly>2</readonly></{reader_profile}></profiles>
    <quotas><default/></quotas>
    <users>
{users}    </users>
</yandex>
"""

USER = """\
        <{name}>
            {password}
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>{profile}</profile>
            <quota>default</quota>
        </{name}>
"""

#: The server's TLS: its certificate from the local CA; clients are not asked for one.
TLS_CONFIG = """\
    <tcp_port_secure>{tls_port}</tcp_port_secure>
    <openSSL>
        <server>
            <certificateFile>{cert}</certificateFile>
            <privateKeyFile>{key}</privateKeyFile>
            <verificationMode>none</verificationMode>
            <loadDefaultCAFile>false</loadDefaultCAFile>
            <cacheSessions>true</cacheSessions>
            <disableProtocols>sslv2,sslv3</disableProtocols>
            <preferServerCiphers>true</preferServerCiphers>
        </server>
    </openSSL>
"""

#: The users of a secured server: the loader's and the read API's (module docstring).
WRITER = "writer"
READER = "reader"
READER_PROFILE = "readonly"


class LocalClickHouseServer:
    """Start, stop and report the server of a `clickhouse://` URL; idempotent like the others.

    `http_port` is the companion HTTP port the server always opens; None picks a free one at start.
    A server of a local cluster (stack/clickhouse_cluster.py) has its own `folder` under
    `state_dir` and `extra_config` (ZooKeeper, macros, remote_servers) inside `<yandex>`.
    """

    def __init__(
        self,
        address: ServerAddress,
        state_dir: Path,
        http_port: int | None = None,
        *,
        folder: str = SERVICE,
        extra_config: str = "",
        tls_port: int | None = None,
        ca: LocalCA | None = None,
    ) -> None:
        self.address = address
        self.tls_port = tls_port
        self.http_port = http_port
        self.extra_config = extra_config
        self.root = state_dir / folder
        self.pidfile = self.root / "clickhouse-server.pid"
        self.stdout_log = self.root / "stdout.log"
        self.error_log = self.root / "server.err.log"
        #: Its own CA unless given the estate's (`pin stack up --secure`: one CA for all).
        self.ca = ca or LocalCA(self.root / "tls")

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalClickHouseServer | None:
        """The server behind `PIN_CLICKHOUSE_URL`, or None for the embedded engine."""
        target = parse_clickhouse_url(
            settings.clickhouse_url, password_file=settings.clickhouse_password_file
        )
        if not isinstance(target, ServerAddress):
            return None
        return cls(target, settings.state_dir)

    @property
    def is_local(self) -> bool:
        return self.address.host in LOOPBACK_HOSTS

    def password_file(self, user: str) -> Path:
        """The file holding `user`'s password on a secured server (0600, made by `up`)."""
        return self.root / f"{user}.password"

    def user_url(self, user: str) -> str:
        """`user`'s PIN_CLICKHOUSE_URL on a secured server: TLS, the server's certificate
        verified against the local CA, the password left to PIN_CLICKHOUSE_PASSWORD_FILE."""
        if self.tls_port is None:
            raise PinError(f"ClickHouse server at {self.address} has no TLS port")
        return (
            f"clickhouses://{user}@127.0.0.1:{self.tls_port}/{DATABASE}"
            f"?verify=true&ca_certs={quote(str(self.ca.cert))}"
        )

    def client_env(self, user: str) -> dict[str, str]:
        """The settings a command runs with as `user` (WRITER: every command; READER: the read
        API and `pin devstats labels`)."""
        return {
            "PIN_CLICKHOUSE_URL": self.user_url(user),
            "PIN_CLICKHOUSE_PASSWORD_FILE": str(self.password_file(user)),
        }

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        # A TLS URL names a server this project did not set up (`pin stack up --secure` starts
        # one through `tls_port`, and manages it through its plaintext admin address).
        if not self.is_local or self.address.secure:
            return self._not_managed()
        pid = read_pid(self.pidfile)
        action = "already running"
        if pid is None:
            if port_open(self.address.host, self.address.port):
                return self._not_managed()
            config = self._write_config()
            pid = start_detached(
                [self._binary(), f"--config-file={config}"],
                pidfile=self.pidfile,
                logfile=self.stdout_log,
                cwd=self.root,
            )
            action = "started"
        launched = time.monotonic()
        wait_until(
            self.ready,
            timeout=60,
            what="ClickHouse server",
            logfile=self.error_log,
            pid=pid,
        )
        return {
            "service": SERVICE,
            "state": action,
            "version": self._version(),
            "port": self.address.port,
            **self._tls_port(),
            "ready_seconds": round(time.monotonic() - launched, 2),
            "total_seconds": round(time.monotonic() - started, 2),
        }

    def down(self) -> dict[str, object]:
        if not self.is_local:
            return {"service": SERVICE, "managed": False, "state": "external"}
        stopped = stop_pid(self.pidfile, grace_seconds=30)
        return {"service": SERVICE, "state": "stopped" if stopped else "not running"}

    def status(self) -> dict[str, object]:
        pid = read_pid(self.pidfile) if self.is_local else None
        version = self._version()
        state = "running" if version else ("starting" if pid else "down")
        return {
            "service": SERVICE,
            "managed": pid is not None,
            "state": state,
            "pid": pid,
            "port": self.address.port,
            **self._tls_port(),
            "version": version,
        }

    def _tls_port(self) -> dict[str, object]:
        return {} if self.tls_port is None else {"tls_port": self.tls_port}

    def _not_managed(self) -> dict[str, object]:
        """A server this project did not start (remote, or already on the port): checked only."""
        version = self._version()
        if version is None:
            raise PinError(
                f"ClickHouse server at {self.address} does not answer (the port is taken by "
                "something else, or the remote server is down)"
            )
        return {
            "service": SERVICE,
            "managed": False,
            "state": "external",
            "version": version,
            "ready_seconds": 0.0,
        }

    def ready(self) -> bool:
        """The server answers queries (`up` returns once it does)."""
        return self._version() is not None

    def _version(self) -> str | None:
        client = ServerClickHouse(self.address, connect_timeout=1.0)
        try:
            return str(client.rows("SELECT version()")[0][0])
        except PinError:
            return None
        finally:
            client.close()

    def _binary(self) -> str:
        found = shutil.which(BINARY) or shutil.which(BINARY, path="/usr/sbin:/usr/bin")
        if found is None:
            apt_install([PACKAGE])
            found = shutil.which(BINARY, path="/usr/sbin:/usr/bin")
        if found is None:
            raise PinError(f"{BINARY} is not installed and could not be installed")
        return found

    def _write_config(self) -> Path:
        for folder in (self.root / "data", self.root / "tmp"):
            folder.mkdir(parents=True, exist_ok=True)
        root = escape(str(self.root))
        users = _user(self.address.user, f"<password>{escape(self.address.password)}</password>")
        extra = self.extra_config
        if self.tls_port is not None:
            for name, profile in ((WRITER, "default"), (READER, READER_PROFILE)):
                digest = hashlib.sha256(self._password(name).encode()).hexdigest()
                users += _user(
                    name, f"<password_sha256_hex>{digest}</password_sha256_hex>", profile
                )
            issued = self.ca.issue(SERVICE)
            extra += TLS_CONFIG.format(
                tls_port=self.tls_port, cert=escape(str(issued.cert)), key=escape(str(issued.key))
            )
        (self.root / "users.xml").write_text(
            USERS.format(reader_profile=READER_PROFILE, users=users)
        )
        config = self.root / "config.xml"
        config.write_text(
            CONFIG.format(
                root=root,
                tcp_port=self.address.port,
                http_port=self.http_port or free_port(),
                extra=extra,
            )
        )
        return config

    def _password(self, user: str) -> str:
        """`user`'s password: generated once, kept in a file only its owner reads."""
        path = self.password_file(user)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_urlsafe(24) + "\n")
        return path.read_text().rstrip("\n")


def _user(name: str, password: str, profile: str = "default") -> str:
    return USER.format(name=escape(name), password=password, profile=profile)
