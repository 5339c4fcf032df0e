"""Debian's `clickhouse-server` (18.16) for the native-protocol path, run from the state folder.

Used when `PIN_CLICKHOUSE_URL` is `clickhouse://…` on loopback (the embedded engine needs none).
The package's own config and init scripts are not used: a small `<yandex>` config under
`<state_dir>/clickhouse-server/` keeps data, logs and ports in the project's hands. 18.16 runs as
root without complaint and needs no `users.d`/`config.d`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from xml.sax.saxutils import escape

from pin_pipelines.clickhouse import ServerAddress, parse_clickhouse_url
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
<!-- Written by `pin stack up`: the URL's user and password, loopback only. -->
<yandex>
    <profiles><default/></profiles>
    <quotas><default/></quotas>
    <users>
        <{user}>
            <password>{password}</password>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </{user}>
    </users>
</yandex>
"""


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
    ) -> None:
        self.address = address
        self.http_port = http_port
        self.extra_config = extra_config
        self.root = state_dir / folder
        self.pidfile = self.root / "clickhouse-server.pid"
        self.stdout_log = self.root / "stdout.log"
        self.error_log = self.root / "server.err.log"

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalClickHouseServer | None:
        """The server behind `PIN_CLICKHOUSE_URL`, or None for the embedded engine."""
        target = parse_clickhouse_url(settings.clickhouse_url)
        if not isinstance(target, ServerAddress):
            return None
        return cls(target, settings.state_dir)

    @property
    def is_local(self) -> bool:
        return self.address.host in LOOPBACK_HOSTS

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        if not self.is_local:
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
            "version": version,
        }

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
        (self.root / "users.xml").write_text(
            USERS.format(
                user=escape(self.address.user),
                password=escape(self.address.password),
            )
        )
        config = self.root / "config.xml"
        config.write_text(
            CONFIG.format(
                root=root,
                tcp_port=self.address.port,
                http_port=self.http_port or free_port(),
                extra=self.extra_config,
            )
        )
        return config
