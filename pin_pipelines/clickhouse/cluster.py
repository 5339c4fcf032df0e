"""The dimension on a ClickHouse cluster (`PIN_CLICKHOUSE_CLUSTER`): the single-node DDL of
`sql/clickhouse/` rewritten into its cluster form, in one place, so the columns are written once.

Each `CREATE TABLE db.t (columns) ENGINE = XMergeTree(args) ORDER BY (key) …` becomes two tables,
both `ON CLUSTER` (distributed DDL: every server of the cluster runs it from ZooKeeper's queue):
- `db.t_local`, on every replica of every shard: the same columns and sorting key, engine
  `ReplicatedXMergeTree('/clickhouse/tables/{shard}/db/t', '{replica}', args)`; each server's
  `macros` name its shard and replica;
- `db.t`, a `Distributed` table with the same name and columns over `db.t_local`, sharded by
  `cityHash64(toString(key))`. The key is the sorting key, so every version of a group lands on one
  shard, where ReplacingMergeTree's merges collapse them; the readers' `argMax(…) GROUP BY
  LayoutGroupId` through the Distributed table then merges per-group states that each come from
  one shard. (`toString`: 18.16's cityHash64 takes no UUID; the text form hashes the same on
  every version, so a group's shard does not change with the server version.)
`CREATE DATABASE` gets `ON CLUSTER`. `ALTER TABLE db.t` becomes the same ALTER of `db.t_local`, `ON
CLUSTER`, and then of `db.t` on each server in turn (18.16 refuses an ALTER ON CLUSTER of a table
that is not replicated): a column added to the replicas first, then to the Distributed table, so
a write through it never names a column the replicas lack (a column with a default is filled by
the replicas while the Distributed table does not send it yet; a column dropped goes in the
other order). A server that has the column added (or dropped) already is skipped, so a migration
that did not reach a server is run again when it is back. A `MODIFY SETTING`
changes the replicas' MergeTree only: a Distributed table has no such settings. Any other
statement has no cluster form yet and raises, so a new migration is written with its cluster
form in mind rather than applied to one node only.

What writes through the Distributed table rely on (ServerClickHouse sends both on every query):
- `insert_distributed_sync = 1`: the INSERT returns once every shard it touched has stored its
  rows on one replica (the shard's other replicas fetch the part from it), so the loader commits
  its Kafka offsets after rows that are stored, not merely queued on the entry server's disk
  (the default, asynchronous mode, whose queue a crash of that server would lose);
- deduplication: 18.16 has no `insert_deduplication_token`. A replicated table keeps the hashes
  of its last `replicated_deduplication_window` (100) inserted blocks in ZooKeeper and drops an
  identical block: a batch sent again (the same events in the same order, so the same rows for
  each shard) is stored once, on whichever replica it reaches. The loader reads its version
  guard again before a retry, so a retry mostly holds only what did not land.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pin_pipelines.clickhouse.legacy import without_non_replicated_dedup_window

#: The shard-local table behind a Distributed table of the same name without the suffix.
LOCAL_SUFFIX = "_local"

_CREATE_DATABASE = re.compile(r"^CREATE\s+DATABASE\s+(IF\s+NOT\s+EXISTS\s+)?\w+$", re.I)
_CREATE_TABLE = re.compile(
    r"^CREATE\s+TABLE\s+(?P<if_not_exists>IF\s+NOT\s+EXISTS\s+)?(?P<db>\w+)\.(?P<table>\w+)\s*"
    r"(?P<columns>\(.*\))\s*ENGINE\s*=\s*(?P<engine>\w*MergeTree)\((?P<args>[^)]*)\)\s*"
    r"(?P<rest>ORDER\s+BY\s+(?P<key>\(\s*\w+\s*\)|\w+)(?!\w).*)$",
    re.I | re.S,
)


_ALTER_TABLE = re.compile(
    r"^ALTER\s+TABLE\s+(?P<db>\w+)\.(?P<table>\w+)\s+(?P<action>(?:"
    r"(?P<adds>ADD\s+COLUMN\s+(?:IF\s+NOT\s+EXISTS\s+)?(?P<added>\w+))"
    r"|(?P<drops>DROP\s+COLUMN\s+(?:IF\s+EXISTS\s+)?(?P<dropped>\w+))"
    r"|(?:MODIFY|COMMENT)\s+COLUMN\s|(?P<setting>MODIFY\s+SETTING\s)).*)$",
    re.I | re.S,
)


@dataclass(frozen=True)
class ClusterStatement:
    """One statement of a migration's cluster form."""

    sql: str
    #: Run on every server of the cluster in turn, not ON CLUSTER: 18.16 refuses an ALTER … ON
    #: CLUSTER of a table that is not replicated (the Distributed one) on a cluster whose shards
    #: replicate internally ("isn't replicated, but shard #2 is replicated", Code 371).
    every_server: bool = False
    #: (table, column, present): the column this statement adds (present) or drops. A server
    #: where that is so already is skipped (18.16 has no ADD COLUMN IF NOT EXISTS), so that a
    #: migration that did not reach every server runs again.
    column: tuple[str, str, bool] | None = None


def ddl_for_cluster(statement: str, cluster: str) -> list[ClusterStatement]:
    """The statements that run `statement` on `cluster` (see the module doc)."""
    if _CREATE_DATABASE.match(statement):
        return [ClusterStatement(f"{statement} ON CLUSTER {cluster}")]
    alter = _ALTER_TABLE.match(statement)
    if alter is not None:
        db, name, action = alter["db"], alter["table"], alter["action"]
        local_sql = f"ALTER TABLE {db}.{name}{LOCAL_SUFFIX} ON CLUSTER {cluster} {action}"
        if alter["setting"]:
            return [ClusterStatement(local_sql)]
        change = column_change(statement)
        local = ClusterStatement(
            local_sql,
            column=change and (f"{change[0]}{LOCAL_SUFFIX}", change[1], change[2]),
        )
        distributed = ClusterStatement(
            f"ALTER TABLE {db}.{name} {action}", every_server=True, column=change
        )
        if alter["drops"]:
            return [distributed, local]  # no write names it any more, then the replicas drop it
        return [local, distributed]
    table = _CREATE_TABLE.match(statement)
    if table is None:
        raise ValueError(
            "no cluster form for this ClickHouse migration statement (cluster.py knows CREATE "
            "DATABASE, CREATE TABLE … MergeTree … ORDER BY one column, and ALTER TABLE … "
            f"ADD/DROP/MODIFY/COMMENT COLUMN or MODIFY SETTING): {statement[:120]!r}"
        )
    create = f"CREATE TABLE {table['if_not_exists'] or ''}"
    db, name, columns = table["db"], table["table"], table["columns"]
    args = ", ".join(
        [f"'/clickhouse/tables/{{shard}}/{db}/{name}'", "'{replica}'"]
        + ([table["args"].strip()] if table["args"].strip() else [])
    )
    replicas = (
        f"{create}{db}.{name}{LOCAL_SUFFIX} ON CLUSTER {cluster}\n{columns}\n"
        f"ENGINE = Replicated{table['engine']}({args})\n"
        + without_non_replicated_dedup_window(table["rest"]).strip()
    )
    over_replicas = (
        f"{create}{db}.{name} ON CLUSTER {cluster}\n{columns}\n"
        f"ENGINE = Distributed({cluster}, {db}, {name}{LOCAL_SUFFIX}, "
        f"cityHash64(toString({table['key'].strip('( )')})))"
    )
    return [ClusterStatement(replicas), ClusterStatement(over_replicas)]


def column_change(statement: str) -> tuple[str, str, bool] | None:
    """(table, column, present) of an ALTER that adds (present) or drops a column, None for any
    other statement: what a server that already ran it shows (18.16 has no `ADD COLUMN IF NOT
    EXISTS`, so a migration that stopped half-way is made re-runnable by looking first)."""
    alter = _ALTER_TABLE.match(statement)
    column = None if alter is None else alter["added"] or alter["dropped"]
    if alter is None or column is None:
        return None
    return f"{alter['db']}.{alter['table']}", column, bool(alter["adds"])


def created_tables(statement: str, cluster: str | None) -> list[str]:
    """The tables (`db.t`) that `statement` creates on each server: its own, and on `cluster`
    also the shard-local table behind it; none for any other statement."""
    table = _CREATE_TABLE.match(statement)
    if table is None:
        return []
    name = f"{table['db']}.{table['table']}"
    return [name] if cluster is None else [f"{name}{LOCAL_SUFFIX}", name]


def distributed_tables(statement: str) -> list[str]:
    """The Distributed table (`db.t`) that `ddl_for_cluster(statement)` creates, if any."""
    table = _CREATE_TABLE.match(statement)
    return [f"{table['db']}.{table['table']}"] if table else []
