"""A PostgreSQL cluster owned by the project: Debian's server binaries, data in the state folder."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

import psycopg

from pin_pipelines.config import PG_SERVER_DEAD_PEER_SETTINGS, Settings, dsn_with_dbname
from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import apt_install, wait_until

#: Databases the platform needs on the server: the chessboard's and Dagster's storage.
DAGSTER_DB = "dagster"


def bindir() -> Path:
    """The newest installed server's bin folder; installs Debian's `postgresql` when none is."""
    for attempt in range(2):
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=_major)
        if found:
            return found[-1].parent
        if attempt == 0:
            apt_install(["postgresql"])
    raise PinError("PostgreSQL server binaries not found under /usr/lib/postgresql")


def _major(pg_ctl: Path) -> int:
    try:
        return int(pg_ctl.parent.parent.name)
    except ValueError:
        return 0


def as_owner(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its tools as the `postgres` system user."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def owner_ids() -> tuple[int, int]:
    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


class LocalPostgres:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.target = settings.pg
        self.root = settings.state_dir / "postgres"
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"

    def pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = as_owner([str(bindir() / "pg_ctl"), "-D", str(self.data), *args])
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise PinError(f"pg_ctl {args[0]} failed: {(result.stderr or result.stdout).strip()}")
        return result

    def running(self) -> bool:
        return (
            self.data.joinpath("PG_VERSION").exists()
            and self.pg_ctl("status", check=False).returncode == 0
        )

    def answers(self) -> bool:
        try:
            with psycopg.connect(self.admin_dsn, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    @property
    def admin_dsn(self) -> str:
        return dsn_with_dbname(self.settings.pg_dsn, "postgres")

    def up(self) -> dict[str, object]:
        started = time.monotonic()
        if not self.target.is_local:
            if not self.answers():
                raise PinError(f"external PostgreSQL at {self.target.address} does not answer")
            self._create_databases()
            return {"service": "postgresql", "state": "external", "ready_seconds": 0.0}
        self._init_cluster()
        self._write_conf()
        action = "already running"
        if self.running():
            # The dead-peer bounds take effect on a reload (a changed port or memory setting
            # waits for the next start).
            self.pg_ctl("reload")
        else:
            self.pg_ctl("start", "-w", "-t", "60", "-l", str(self.logfile))
            action = "started"
        wait_until(self.answers, timeout=60, what="PostgreSQL", logfile=self.logfile)
        self._create_databases()
        return {
            "service": "postgresql",
            "state": action,
            "port": self.target.port,
            "version": self.server_version(),
            "ready_seconds": round(time.monotonic() - started, 2),
        }

    def down(self) -> dict[str, object]:
        if not self.target.is_local or not self.running():
            return {"service": "postgresql", "state": "stopped"}
        self.pg_ctl("stop", "-m", "fast", "-w", "-t", "60")
        return {"service": "postgresql", "state": "stopped"}

    def status(self) -> dict[str, object]:
        return {
            "service": "postgresql",
            "managed": self.target.is_local,
            "state": "running" if self.answers() else "down",
            "port": self.target.port,
        }

    def server_version(self) -> str:
        with psycopg.connect(self.admin_dsn, connect_timeout=2) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    def _init_cluster(self) -> None:
        if self.data.joinpath("PG_VERSION").exists():
            return
        uid, gid = owner_ids()
        for folder in (self.root, self.data, self.root / "run"):
            folder.mkdir(parents=True, exist_ok=True)
            os.chown(folder, uid, gid)
        self.data.chmod(0o700)
        argv = as_owner(
            [
                str(bindir() / "initdb"),
                "-D",
                str(self.data),
                "-U",
                self.target.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
            ]
        )
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise PinError(f"initdb failed: {(result.stderr or result.stdout).strip()[-300:]}")
        with self.data.joinpath("postgresql.conf").open("a") as conf:
            conf.write("\ninclude_if_exists = 'pin.conf'\n")

    def _write_conf(self) -> None:
        """Rewritten on every `up`, so a changed PIN_PG_DSN port takes effect on the next start."""
        conf = self.data / "pin.conf"
        conf.write_text(
            "# Written by `pin stack up`; edits are overwritten.\n"
            "listen_addresses = '127.0.0.1'\n"
            f"port = {self.target.port}\n"
            f"unix_socket_directories = '{self.root / 'run'}'\n"
            # Dagster's webserver, daemon and every run worker hold connections of their own.
            "max_connections = 300\n"
            "shared_buffers = 512MB\n"
            "work_mem = 16MB\n"
            "max_wal_size = 2GB\n"
            "log_min_duration_statement = 2000\n"
            + "".join(f"{name} = {value}\n" for name, value in PG_SERVER_DEAD_PEER_SETTINGS.items())
        )
        uid, gid = owner_ids()
        os.chown(conf, uid, gid)

    def _create_databases(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=5) as conn:
            for name in (self.target.dbname, DAGSTER_DB):
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
                ).fetchone()
                if not exists:
                    conn.execute(
                        psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
                    )
