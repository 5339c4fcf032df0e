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
`CREATE DATABASE` gets `ON CLUSTER`. Any other statement has no cluster form yet and raises, so a
new migration is written with its cluster form in mind rather than applied to one node only.

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


def ddl_for_cluster(statement: str, cluster: str) -> list[str]:
    """The statements that create `statement`'s objects on `cluster` (see the module doc)."""
    if _CREATE_DATABASE.match(statement):
        return [f"{statement} ON CLUSTER {cluster}"]
    table = _CREATE_TABLE.match(statement)
    if table is None:
        raise ValueError(
            "no cluster form for this ClickHouse migration statement (cluster.py knows CREATE "
            f"DATABASE and CREATE TABLE … MergeTree … ORDER BY one column): {statement[:120]!r}"
        )
    create = f"CREATE TABLE {table['if_not_exists'] or ''}"
    db, name, columns = table["db"], table["table"], table["columns"]
    args = ", ".join(
        [f"'/clickhouse/tables/{{shard}}/{db}/{name}'", "'{replica}'"]
        + ([table["args"].strip()] if table["args"].strip() else [])
    )
    local = (
        f"{create}{db}.{name}{LOCAL_SUFFIX} ON CLUSTER {cluster}\n{columns}\n"
        f"ENGINE = Replicated{table['engine']}({args})\n"
        + without_non_replicated_dedup_window(table["rest"]).strip()
    )
    distributed = (
        f"{create}{db}.{name} ON CLUSTER {cluster}\n{columns}\n"
        f"ENGINE = Distributed({cluster}, {db}, {name}{LOCAL_SUFFIX}, "
        f"cityHash64(toString({table['key'].strip('( )')})))"
    )
    return [local, distributed]


def distributed_tables(statement: str) -> list[str]:
    """The Distributed table (`db.t`) that `ddl_for_cluster(statement)` creates, if any."""
    table = _CREATE_TABLE.match(statement)
    return [f"{table['db']}.{table['table']}"] if table else []
