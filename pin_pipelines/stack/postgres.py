"""A PostgreSQL cluster owned by the project: Debian's server binaries, data in the state folder.

Plain (the dev stack: the DSN's user is the cluster's superuser, trusted on loopback), or secured
(`secure=True`, CONTRACT section 8, `pin stack up --secure` and the tests of it): TLS only on
loopback with a certificate of the local CA, SCRAM passwords, and the DSN's user a login role
that is no superuser (CREATEDB, CREATEROLE) owning the chessboard's and Dagster's databases, as a
managed PostgreSQL hands it out. Its superuser `postgres` is reached on the unix socket only, by
the OS user that runs `pin` (peer authentication).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlencode

import psycopg
from psycopg import sql

from pin_pipelines.config import PG_SERVER_DEAD_PEER_SETTINGS, Settings, dsn_with_dbname
from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import apt_install, wait_until
from pin_pipelines.stack.tls import LocalCA

#: Databases the platform needs on the server: the chessboard's and Dagster's storage.
DAGSTER_DB = "dagster"
#: The secured cluster's superuser, reached on the unix socket alone.
SUPERUSER = "postgres"
#: pg_hba.conf of the secured cluster: TLS and SCRAM from loopback, plaintext refused (its
#: "no pg_hba.conf entry … no encryption" is what a plaintext client reads), the superuser on
#: the socket for the OS user that manages the cluster (pg_ident.conf map `pin_admin`).
SECURE_HBA = (
    "# Written by `pin stack up --secure`; edits are overwritten.\n"
    f"local all {SUPERUSER} peer map=pin_admin\n"
    "hostssl all all 127.0.0.1/32 scram-sha-256\n"
    "hostssl all all ::1/128 scram-sha-256\n"
    "hostnossl all all 0.0.0.0/0 reject\n"
    "hostnossl all all ::/0 reject\n"
)


def bindir() -> Path:
    """The newest installed server's bin folder; installs Debian's `postgresql` when none is."""
    for attempt in range(2):
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=_major)
        if found:
            return found[-1].parent
        if attempt == 0:
            apt_install(["postgresql"])
    raise PinError("PostgreSQL server binaries not found under /usr/lib/postgresql")


def scram_verifier(conn: psycopg.Connection, role: str, password: str) -> sql.Literal:
    """`password` as the SCRAM-SHA-256 verifier libpq computes for `role` (the literal of an
    ALTER/CREATE ROLE … PASSWORD): the clear text never reaches the server, nor its log."""
    verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
    return sql.Literal(verifier.decode())


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
    def __init__(self, settings: Settings, *, secure: bool = False) -> None:
        self.settings = settings
        self.target = settings.pg
        self.secure = secure
        self.root = settings.state_dir / "postgres"
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"
        self.socket_dir = self.root / "run"
        #: Secured: the passwords (one file per role) and the libpq passfile, 0600 in a 0700
        #: folder; the CA is the estate's, shared with the other secured services.
        self.secrets = self.root / "secrets"
        self.passfile = self.secrets / "pgpass"
        self.ca = LocalCA(settings.state_dir / "tls")

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
        if self.secure:
            query = urlencode({"host": str(self.socket_dir), "port": self.target.port})
            return f"postgresql://{SUPERUSER}@/postgres?{query}"
        return dsn_with_dbname(self.settings.pg_dsn, "postgres")

    def client_dsn(self, user: str | None = None) -> str:
        """The PIN_PG_DSN to export for the secured cluster: its owner (or the login role
        `user`, whose password `password` put in the passfile) over verified TLS, the password
        read from the passfile at each connect."""
        query = urlencode(
            {"sslmode": "verify-full", "sslrootcert": self.ca.cert, "passfile": self.passfile},
            safe="/",
        )
        t = self.target
        return f"postgresql://{user or t.user}@127.0.0.1:{t.port}/{t.dbname}?{query}"

    def password(self, role: str) -> str:
        """`role`'s password, made on first use (file `<secrets>/<role>.password`, 0600) and
        written to the passfile, so a login role of the secured cluster connects with
        `client_dsn`'s parameters and its own user name. Setting it on the role is the caller's
        (`up` does it for the owner)."""
        self.secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
        stored = self.secrets / f"{role}.password"
        if not stored.exists():
            stored.touch(mode=0o600)
            stored.write_text(secrets.token_urlsafe(24))
        password = stored.read_text().strip()
        lines = self.passfile.read_text().splitlines() if self.passfile.exists() else []
        ours = [
            f"{host}:{self.target.port}:*:{role}:{password}" for host in ("127.0.0.1", "localhost")
        ]
        kept = [line for line in lines if line.split(":")[3:4] != [role]]
        self.passfile.touch(mode=0o600)
        self.passfile.write_text("".join(f"{line}\n" for line in [*kept, *ours]))
        return password

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
        if self.secure:
            self._create_owner()
        self._create_databases()
        return {
            "service": "postgresql",
            "state": action,
            "secure": self.secure,
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
            "secure": self.secure,
            "port": self.target.port,
        }

    def server_version(self) -> str:
        with psycopg.connect(self.admin_dsn, connect_timeout=2) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    @property
    def _mode(self) -> str:
        return "secure" if self.secure else "plain"

    def _init_cluster(self) -> None:
        """initdb once; the cluster's mode is kept beside it (`pin.mode`): a plain cluster has
        no `postgres` superuser and its owner is one, so it cannot be turned secured in place
        (nor back), and `up` says so instead of waiting for a login that cannot succeed."""
        marker = self.root / "pin.mode"
        if self.data.joinpath("PG_VERSION").exists():
            made = marker.read_text().strip() if marker.exists() else "plain"
            if made != self._mode:
                raise PinError(
                    f"the PostgreSQL cluster in {self.data} was made {made}, not {self._mode}: "
                    f"stop it (`pin stack down`) and move {self.root} away to make a new one"
                )
            return
        uid, gid = owner_ids()
        for folder in (self.root, self.data, self.socket_dir):
            folder.mkdir(parents=True, exist_ok=True)
            os.chown(folder, uid, gid)
        self.data.chmod(0o700)
        argv = as_owner(
            [
                str(bindir() / "initdb"),
                "-D",
                str(self.data),
                "-U",
                SUPERUSER if self.secure else self.target.user,
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
        marker.write_text(f"{self._mode}\n")

    def _write_conf(self) -> None:
        """Rewritten on every `up`, so a changed PIN_PG_DSN port takes effect on the next start."""
        conf = self.data / "pin.conf"
        conf.write_text(
            "# Written by `pin stack up`; edits are overwritten.\n"
            "listen_addresses = '127.0.0.1'\n"
            f"port = {self.target.port}\n"
            f"unix_socket_directories = '{self.socket_dir}'\n"
            # Dagster's webserver, daemon and every run worker hold connections of their own.
            "max_connections = 300\n"
            "shared_buffers = 512MB\n"
            "work_mem = 16MB\n"
            "max_wal_size = 2GB\n"
            "log_min_duration_statement = 2000\n"
            + "".join(f"{name} = {value}\n" for name, value in PG_SERVER_DEAD_PEER_SETTINGS.items())
            + (self._secure_conf() if self.secure else "")
        )
        uid, gid = owner_ids()
        os.chown(conf, uid, gid)

    def _secure_conf(self) -> str:
        """TLS with a certificate of the local CA (its key copied into the data folder: the
        server reads it only when its own OS user owns it, 0600), SCRAM, and the secured
        pg_hba.conf / pg_ident.conf; the lines for postgresql.conf."""
        uid, gid = owner_ids()
        issued = self.ca.issue("postgres")
        for source, name in ((issued.cert, "server.crt"), (issued.key, "server.key")):
            target = self.data / name
            shutil.copyfile(source, target)
            os.chown(target, uid, gid)
            target.chmod(0o600)
        self.data.joinpath("pg_hba.conf").write_text(SECURE_HBA)
        self.data.joinpath("pg_ident.conf").write_text(
            f"pin_admin {pwd.getpwuid(os.geteuid()).pw_name} {SUPERUSER}\n"
        )
        return (
            "ssl = on\n"
            "ssl_cert_file = 'server.crt'\n"
            "ssl_key_file = 'server.key'\n"
            "ssl_min_protocol_version = 'TLSv1.2'\n"
            "password_encryption = 'scram-sha-256'\n"
        )

    def _create_owner(self) -> None:
        """The DSN's user as the secured cluster's owner role: login, no superuser, CREATEDB and
        CREATEROLE (it creates the group roles at `pin db migrate`), its password from
        `password` (set again at each `up`: the file is the truth)."""
        owner = sql.Identifier(self.target.user)
        with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=5) as conn:
            password = scram_verifier(conn, self.target.user, self.password(self.target.user))
            exists = conn.execute(
                "SELECT 1 FROM pg_roles WHERE rolname = %s", (self.target.user,)
            ).fetchone()
            verb = sql.SQL("ALTER" if exists else "CREATE")
            conn.execute(
                sql.SQL("{} ROLE {} LOGIN NOSUPERUSER CREATEDB CREATEROLE PASSWORD {}").format(
                    verb, owner, password
                )
            )

    def _create_databases(self) -> None:
        """The chessboard's and Dagster's databases where missing; secured, owned by the owner
        role (so it may migrate them and create Dagster's tables)."""
        owner = sql.SQL(" OWNER {}").format(sql.Identifier(self.target.user))
        with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=5) as conn:
            for name in (self.target.dbname, DAGSTER_DB):
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
                ).fetchone()
                if not exists:
                    conn.execute(
                        sql.SQL("CREATE DATABASE {}{}").format(
                            sql.Identifier(name), owner if self.secure else sql.SQL("")
                        )
                    )
