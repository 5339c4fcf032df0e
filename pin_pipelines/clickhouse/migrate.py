"""`pin db migrate` for ClickHouse: the versioned files of `sql/clickhouse/migrations/`, each
applied once, in name order, and recorded in a journal (`sql/clickhouse/journal.sql`), as yoyo
does for PostgreSQL.

A migration file is never edited once it ran somewhere (the journal keeps its SHA-256 and a
changed file is refused): a change to a table is a new file, and `sql/clickhouse/schema.sql` is
edited beside it (a test holds the two equal). A database migrated before the journal existed
gets its journal on the next run, which applies every file again: the first ones are
`IF NOT EXISTS`, so that re-run finds every table in place. A migration that stopped half-way
(not journaled) runs again: a column it added (dropped) already is looked for first, since 18.16
has no `ADD COLUMN IF NOT EXISTS`. And every run makes the tables of
the current definition that the server lacks (a replaced server's empty disk), from it.

With a cluster (`PIN_CLICKHOUSE_CLUSTER`) each statement is applied in its cluster form
(cluster.py), `ON CLUSTER`: the journal too, so every server reads one journal. An ON CLUSTER
statement that a server which is down cannot run stays in ZooKeeper's DDL queue and runs there
when it is back; the migration sends every statement anyway (each waits DDL_TIMEOUT_SECONDS for
the hosts), records the migration (the queue will run it), and then fails saying so. A statement
run server by server (a Distributed table's ALTER) that does not reach a server leaves its
migration out of the journal and fails naming the server: the next run completes it.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

from pin_pipelines.clickhouse.client import ClickHouse, ClickHouseUnavailable
from pin_pipelines.clickhouse.cluster import (
    LOCAL_SUFFIX,
    column_change,
    created_tables,
    ddl_for_cluster,
    distributed_tables,
)
from pin_pipelines.clickhouse.legacy import downgrade_ddl_for_legacy_server, is_legacy_server
from pin_pipelines.clickhouse.sqlfiles import (
    CLICKHOUSE_JOURNAL,
    CLICKHOUSE_MIGRATIONS_DIR,
    CLICKHOUSE_SCHEMA,
    statements,
)
from pin_pipelines.errors import PinError

#: How long an ON CLUSTER statement waits for every host to run it (the server's
#: `distributed_ddl_task_timeout`, 180 s by default). Below the client's 60 s receive timeout
#: (server.py): past that the client would give up first and report the server it talks to as
#: unreachable, instead of the server's own answer that some hosts have not run it yet.
DDL_TIMEOUT_SECONDS = 45

#: The server's answer to an ON CLUSTER statement that not every host ran within the timeout.
_DDL_TIMEOUT_CODE = 159

JOURNAL_TABLE = "pin_dev_stats.schema_migrations"


def migrate_clickhouse(
    ch: ClickHouse,
    cluster: str | None = None,
    ddl_timeout: int = DDL_TIMEOUT_SECONDS,
    migrations: Path = CLICKHOUSE_MIGRATIONS_DIR,
) -> list[str]:
    """Apply the migrations of `migrations` that the journal does not hold, on `cluster` when
    given; returns their versions (none on a re-run)."""
    if cluster is not None:
        _require_cluster(ch, cluster)
    apply = _Applier(ch, cluster, ddl_timeout)
    journal_ddl = statements(CLICKHOUSE_JOURNAL)
    if not _holds(ch, journal_ddl, cluster):  # an ON CLUSTER statement waits for every host
        for statement in journal_ddl:
            apply(statement)
    if cluster is not None:
        # A Distributed read prefers the server's own replica, which may not have fetched the
        # journal's last rows yet (a server back from an outage): a migration read as not
        # applied would run again (seen: a CREATE applied twice, harmless but misreported).
        ch.command(f"SYSTEM SYNC REPLICA {JOURNAL_TABLE}{LOCAL_SUFFIX}")
    done = journal(ch)
    applied: list[str] = []
    for path in sorted(migrations.glob("*.sql")):
        version, checksum = path.stem, _checksum(path)
        if version in done:
            if done[version] != checksum:
                raise PinError(
                    f"ClickHouse migration {version} was changed after it was applied "
                    f"({path}): a change to a table is a new migration file"
                )
            continue
        for statement in statements(path):
            apply(statement)
        if apply.unreached:
            servers = ", ".join(sorted(apply.unreached))
            raise PinError(
                f"ClickHouse migration {version} did not reach {servers} (a Distributed "
                "table's ALTER runs server by server); it is not in the journal: run `pin db "
                "migrate` again once they answer (what ran is not run twice): "
                f"{next(iter(apply.unreached.values()))}"
            )
        ch.insert(
            JOURNAL_TABLE,
            ("Version", "Checksum", "AppliedAt"),
            [(version, checksum, datetime.now(UTC).replace(microsecond=0, tzinfo=None))],
        )
        applied.append(version)
    for statement in statements(CLICKHOUSE_SCHEMA):
        # The journal says what ran, not what this server holds: a table it lacks (a replaced
        # server's empty disk, a table moved aside) is made from the current definition.
        if not _holds(ch, [statement], cluster):
            apply(statement)
        if cluster is not None:
            for table in distributed_tables(statement):
                _require_distributed(ch, table)
    if apply.queued:
        raise PinError(
            f"{len(apply.queued)} ON CLUSTER statement(s) did not run on every server of "
            f"{cluster} within {ddl_timeout} s; they stay queued in ZooKeeper and run on those "
            f"servers when they are back (run `pin db migrate` again then to confirm): "
            f"{apply.queued[0]}"
        )
    return applied


def journal(ch: ClickHouse) -> dict[str, str]:
    """The migrations the journal holds: each version's checksum."""
    rows = ch.rows(
        f"SELECT Version, argMax(Checksum, AppliedAt) FROM {JOURNAL_TABLE} GROUP BY Version"
    )
    return {str(version): str(checksum) for version, checksum in rows}


class _Applier:
    """Runs one migration statement in the server's dialect, in its cluster form on a cluster.
    Keeps the ON CLUSTER statements that some host has not run yet (queued for it), and the
    servers that a statement run server by server did not reach."""

    def __init__(self, ch: ClickHouse, cluster: str | None, ddl_timeout: int) -> None:
        self.ch, self.cluster, self.ddl_timeout = ch, cluster, ddl_timeout
        self.legacy = is_legacy_server(ch.server_version)
        self.queued: list[str] = []
        self.unreached: dict[str, str] = {}  # server → why

    def __call__(self, statement: str) -> None:
        if self.legacy:
            statement = downgrade_ddl_for_legacy_server(statement)
            if not statement:  # nothing this server has (a setting it does not know)
                return
        if self.cluster is None:
            if not _done(self.ch, column_change(statement)):
                self.ch.command(statement)
            return
        for step in ddl_for_cluster(statement, self.cluster):
            if step.every_server:
                for server in _servers(self.ch, self.cluster):
                    with server:
                        try:
                            if not _done(server, step.column):
                                server.command(step.sql)
                        except ClickHouseUnavailable as exc:
                            self.unreached[server.location] = str(exc)
            elif not _done(self.ch, step.column):
                self._on_cluster(step.sql)

    def _on_cluster(self, ddl: str) -> None:
        # Per statement: the driver reconnects after a server error, and a new connection has
        # the server's default again.
        self.ch.command(f"SET distributed_ddl_task_timeout = {int(self.ddl_timeout)}")
        try:
            self.ch.command(ddl)
        except ClickHouseUnavailable as exc:
            if getattr(exc.__cause__, "code", None) != _DDL_TIMEOUT_CODE:
                raise
            self.queued.append(str(exc))  # ran here; queued for the hosts that are down


def _servers(ch: ClickHouse, cluster: str) -> list[ClickHouse]:
    """A client of each server of `cluster`, with `ch`'s user, password and TLS, by the name
    remote_servers gives it (what a server certificate names, rather than its address)."""
    rows = ch.rows(
        "SELECT DISTINCT host_name, port FROM system.clusters WHERE cluster = %(cluster)s "
        "ORDER BY host_name, port",
        {"cluster": cluster},
    )
    return [ch.sibling(str(host), int(port)) for host, port in rows]


def _done(ch: ClickHouse, change: tuple[str, str, bool] | None) -> bool:
    """Whether the column a statement adds (drops) is there (gone) on the server already
    (`change`: cluster.column_change; None for a statement that is run each time)."""
    if change is None:
        return False
    table, column, present = change
    database, name = table.split(".")
    [(found,)] = ch.rows(
        "SELECT count() FROM system.columns "
        "WHERE database = %(db)s AND table = %(table)s AND name = %(column)s",
        {"db": database, "table": name, "column": column},
    )
    return bool(found) == present


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _holds(ch: ClickHouse, ddl: list[str], cluster: str | None) -> bool:
    """Whether the server has every table that `ddl` creates (on `cluster`: in its cluster
    form, the shard-local tables too)."""
    for table in (t for statement in ddl for t in created_tables(statement, cluster)):
        database, name = table.split(".")
        found = ch.rows(
            "SELECT count() FROM system.tables WHERE database = %(db)s AND name = %(name)s",
            {"db": database, "name": name},
        )
        if not found[0][0]:
            return False
    return True


def _require_cluster(ch: ClickHouse, cluster: str) -> None:
    """A cluster unknown to the server would fail every ON CLUSTER statement less clearly."""
    found = ch.rows(
        "SELECT count() FROM system.clusters WHERE cluster = %(cluster)s", {"cluster": cluster}
    )
    if not found[0][0]:
        raise PinError(
            f"PIN_CLICKHOUSE_CLUSTER={cluster}, but ClickHouse at {ch.location} has no such "
            "cluster in its remote_servers (PIN_CLICKHOUSE_URL must name one of its servers)"
        )


def _require_distributed(ch: ClickHouse, table: str) -> None:
    """`IF NOT EXISTS` keeps a table made before the cluster setting was: a single-node table
    under the Distributed table's name would take every write while the cluster stays empty.
    Checked on every run, for every table of the current definition."""
    database, name = table.split(".")
    [(engine,)] = ch.rows(
        "SELECT engine FROM system.tables WHERE database = %(db)s AND name = %(name)s",
        {"db": database, "name": name},
    )
    if engine != "Distributed":
        raise PinError(
            f"{table} on {ch.location} is a {engine} table, not Distributed: it was created "
            "before PIN_CLICKHOUSE_CLUSTER was set; move it aside as docs/runbook.md says "
            "(ClickHouse cluster), then migrate again"
        )
