"""A private PostgreSQL primary and its streaming standby, for the failover tests (CONTRACT §9).

Each server is a `LocalPostgres` (pin_pipelines/stack/postgres.py: Debian's binaries, run as the
`postgres` OS user, the project's postgresql.conf) in a folder of its own under a temporary one:
the primary is initdb'd and started as `pin stack up` does, the standby is a `pg_basebackup -R`
of it started the same way. `dsn` names both, libpq picks the one that takes writes.

- `switchover()`: the planned one. The primary stops cleanly (`-m fast`: its WAL up to the
  shutdown checkpoint reaches the standby first), then the standby is promoted.
- `cut_replication()` then `fail_over()`: the unplanned one. The standby stops streaming (its
  walreceiver ends, so what the primary commits from then on never reaches it), the primary is
  killed (`-m immediate`) and the standby promoted without the primary's last transactions.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.stack.postgres import LocalPostgres, as_owner, bindir, owner_ids
from pin_pipelines.stack.process import free_port, wait_until

#: Seconds a server has to start, stop or finish its promotion.
PG_CTL_SECONDS = "60"


def _server(root: Path, port: int) -> LocalPostgres:
    return LocalPostgres(
        Settings.from_env(
            {
                "PIN_STATE_DIR": str(root),
                "PIN_PG_DSN": f"postgresql://postgres@127.0.0.1:{port}/pin",
            }
        )
    )


class StreamingPair:
    """A primary and its asynchronous streaming standby on free loopback ports."""

    def __init__(self, root: Path) -> None:
        self.primary = _server(root / "primary", free_port())
        self.standby = _server(root / "standby", free_port())

    @property
    def dsn(self) -> str:
        """The chessboard database on both hosts, the writable one wherever it is."""
        hosts = f"127.0.0.1:{self.primary.target.port},127.0.0.1:{self.standby.target.port}"
        return f"postgresql://postgres@{hosts}/pin?target_session_attrs=read-write"

    def start(self) -> None:
        self.primary.up()
        uid, gid = owner_ids()
        for folder in (self.standby.root, self.standby.root / "run"):
            folder.mkdir(parents=True)
            os.chown(folder, uid, gid)
        backup = [
            str(bindir() / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(self.primary.target.port), "-U", "postgres"),
            *("-D", str(self.standby.data), "-R", "-X", "stream", "-c", "fast"),
        ]
        done = subprocess.run(as_owner(backup), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PinError(f"pg_basebackup failed: {(done.stderr or done.stdout).strip()[-300:]}")
        self.standby.up()  # writes its own port and socket folder over the primary's copy
        wait_until(self.streaming, timeout=30, what="the standby's streaming replication")

    def streaming(self) -> bool:
        """The standby's walreceiver is connected and streaming."""
        with psycopg.connect(self.standby.admin_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT status FROM pg_stat_wal_receiver").fetchone()
        return row is not None and row[0] == "streaming"

    def switchover(self) -> None:
        self.primary.pg_ctl("stop", "-m", "fast", "-w", "-t", PG_CTL_SECONDS)
        self.standby.pg_ctl("promote", "-w", "-t", PG_CTL_SECONDS)

    def cut_replication(self) -> None:
        """The standby stops receiving WAL (primary_conninfo emptied and reloaded): from now on
        the primary's commits are its alone, as when an asynchronous standby lags."""
        with psycopg.connect(self.standby.admin_dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")
        wait_until(lambda: not self._receiving(), timeout=30, what="the standby's walreceiver end")

    def _receiving(self) -> bool:
        with psycopg.connect(self.standby.admin_dsn, autocommit=True) as conn:
            return conn.execute("SELECT 1 FROM pg_stat_wal_receiver").fetchone() is not None

    def fail_over(self) -> None:
        self.primary.pg_ctl("stop", "-m", "immediate", "-w", "-t", PG_CTL_SECONDS)
        self.standby.pg_ctl("promote", "-w", "-t", PG_CTL_SECONDS)

    def stop(self) -> None:
        """Both servers gone, whatever state they are in."""
        for server in (self.primary, self.standby):
            if server.running():
                server.pg_ctl("stop", "-m", "immediate", "-w", "-t", PG_CTL_SECONDS, check=False)


@contextlib.contextmanager
def streaming_pair() -> Iterator[StreamingPair]:
    """A started pair in a temporary folder (under /tmp, readable by the `postgres` user, which
    pytest's own folders are not), stopped and removed at the end whatever happens."""
    with tempfile.TemporaryDirectory(prefix="pin-pg-failover-") as folder:
        root = Path(folder)
        root.chmod(0o755)
        pair = StreamingPair(root)
        try:
            pair.start()
            yield pair
        finally:
            pair.stop()
