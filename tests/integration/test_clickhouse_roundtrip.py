"""One client over both ClickHouse paths: the embedded engine (chdb) and Debian's 18.16 server."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import (
    ClickHouse,
    ClickHouseError,
    ClickHouseUnavailable,
    migrate_clickhouse,
    open_clickhouse,
)
from pin_pipelines.clickhouse.legacy import is_legacy_server
from pin_pipelines.clickhouse.literals import UuidSet
from pin_pipelines.clickhouse.migrate import JOURNAL_TABLE
from pin_pipelines.devstats.events import COLUMNS
from pin_pipelines.errors import PinError
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.process import free_port
from tests.support.clickhouse import server_url

#: Alone on the machine: it drops the dimension of the stack's shared ClickHouse server, which
#: other modules' tests read and write.
pytestmark = pytest.mark.alone

TABLE = "pin_dev_stats.dim_layout_group"
AWKWARD = 'Люкс с видом на море: it\'s "quoted", back\\slash, tab\t, new\nline, nul\0 %(x)s'


def test_migrate_twice_creates_the_contract_table(clickhouse: ClickHouse) -> None:
    """Creates the table where it is missing (with the journal: a server never migrated), then
    nothing; the column types are the spec's, except the one downgrade on 18.16."""
    clickhouse.command(f"DROP TABLE IF EXISTS {TABLE}")
    clickhouse.command(f"DROP TABLE IF EXISTS {JOURNAL_TABLE}")
    assert migrate_clickhouse(clickhouse) == ["0001_dim_layout_group"]
    assert migrate_clickhouse(clickhouse) == []
    columns = [row[:2] for row in clickhouse.rows("DESCRIBE TABLE pin_dev_stats.dim_layout_group")]
    legacy = is_legacy_server(clickhouse.server_version)
    assert columns == [
        ("LayoutGroupId", "UUID"),
        ("ProjectId", "UUID"),
        ("DeveloperId", "UUID"),
        ("Name", "String"),
        ("SortOrder", "Int32"),
        ("IsArchived", "UInt8"),
        ("SourceVersion", "Int64"),
        ("UpsertedAt", "DateTime" if legacy else "DateTime64(3)"),
    ]
    [(engine, sorting_key, partition_key)] = clickhouse.rows(
        "SELECT engine, sorting_key, partition_key FROM system.tables "
        "WHERE database = 'pin_dev_stats' AND name = 'dim_layout_group'"
    )
    assert (engine, sorting_key.strip("()"), partition_key) == (
        "ReplacingMergeTree",
        "LayoutGroupId",
        "",
    )


def test_rows_round_trip_with_python_types(clickhouse: ClickHouse) -> None:
    gid, pid, dev = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    older = datetime(2024, 5, 1, 10, 0, 0, 456000, tzinfo=UTC)
    newer = datetime(2024, 5, 1, 10, 0, 7, tzinfo=UTC)
    clickhouse.insert(
        TABLE,
        COLUMNS,
        [(gid, pid, dev, "old", 1, 0, 1, older), (gid, pid, dev, AWKWARD, -5, 1, 2, newer)],
    )
    latest = clickhouse.rows(
        "SELECT LayoutGroupId, argMax(ProjectId, UpsertedAt), argMax(Name, UpsertedAt), "
        "argMax(SortOrder, UpsertedAt), argMax(IsArchived, UpsertedAt), "
        "argMax(SourceVersion, UpsertedAt), toUnixTimestamp(max(UpsertedAt)) "
        "FROM pin_dev_stats.dim_layout_group WHERE DeveloperId = %(dev)s GROUP BY LayoutGroupId",
        {"dev": dev},
    )
    assert latest == [(gid, pid, AWKWARD, -5, 1, 2, int(newer.timestamp()))]


def test_parameters_are_escaped_literals(clickhouse: ClickHouse) -> None:
    """What goes in as a parameter comes back unchanged from both engines."""
    ids = (uuid.uuid4(), uuid.uuid4())
    [(text, number, found)] = clickhouse.rows(
        "SELECT %(text)s, %(number)s, toUUID(%(id)s) IN %(ids)s",
        {"text": AWKWARD, "number": -(2**40), "id": ids[1], "ids": ids},
    )
    assert (text, number, found) == (AWKWARD, -(2**40), 1)


def test_a_uuid_set_filters_like_in(clickhouse: ClickHouse) -> None:
    """UuidSet is an external table on the server and a split string in chdb: the same rows."""
    ids = [uuid.uuid4() for _ in range(1000)]
    wanted = set(ids[::3]) | {uuid.uuid4()}  # one id that is not there
    dev = uuid.uuid4()
    at = datetime(2024, 1, 1, tzinfo=UTC)
    clickhouse.insert(TABLE, COLUMNS, [(i, i, dev, "g", 0, 0, 1, at) for i in ids])
    found = clickhouse.rows(
        "SELECT LayoutGroupId FROM pin_dev_stats.dim_layout_group"
        " WHERE DeveloperId = %(dev)s AND LayoutGroupId IN %(ids)s",
        {"dev": dev, "ids": UuidSet(wanted)},
    )
    assert sorted(gid for (gid,) in found) == sorted(set(ids[::3]))


def test_records_give_each_value_under_its_alias(clickhouse: ClickHouse) -> None:
    """`records` is `rows` by name: the select's aliases (or the column's own name) as keys, the
    same Python values as `rows`, with a UuidSet parameter as well (an external table on the
    server); an empty result is an empty list."""
    gid, dev = uuid.uuid4(), uuid.uuid4()
    at = datetime(2024, 1, 1, tzinfo=UTC)
    clickhouse.insert(TABLE, COLUMNS, [(gid, gid, dev, "Студии", -3, 1, 7, at)])
    sql = (
        "SELECT LayoutGroupId, argMax(Name, UpsertedAt) AS name, argMax(SortOrder, UpsertedAt)"
        " AS sort_order, argMax(IsArchived, UpsertedAt) AS is_archived"
        " FROM pin_dev_stats.dim_layout_group WHERE LayoutGroupId IN %(ids)s"
        " GROUP BY LayoutGroupId"
    )
    params = {"ids": UuidSet([gid])}
    assert clickhouse.records(sql, params) == [
        {"LayoutGroupId": gid, "name": "Студии", "sort_order": -3, "is_archived": 1}
    ]
    assert [tuple(r.values()) for r in clickhouse.records(sql, params)] == clickhouse.rows(
        sql, params
    )
    assert clickhouse.records(sql, {"ids": UuidSet([uuid.uuid4()])}) == []


def test_retried_insert_with_the_same_token(clickhouse: ClickHouse) -> None:
    """Stored once where the engine deduplicates (chdb, current servers); 18.16 has no token, so
    it stores the row twice, and the argMax read is the same either way."""
    gid, dev = uuid.uuid4(), uuid.uuid4()
    row = (gid, uuid.uuid4(), dev, "same", 1, 0, 1, datetime(2024, 1, 1, tzinfo=UTC))
    for _ in range(2):
        clickhouse.insert(TABLE, COLUMNS, [row], dedup_token=f"test-{gid}")
    [(stored,)] = clickhouse.rows(
        "SELECT count() FROM pin_dev_stats.dim_layout_group WHERE LayoutGroupId = %(id)s",
        {"id": gid},
    )
    assert stored == (2 if is_legacy_server(clickhouse.server_version) else 1)
    assert clickhouse.rows(
        "SELECT argMax(Name, UpsertedAt) FROM pin_dev_stats.dim_layout_group "
        "WHERE LayoutGroupId = %(id)s GROUP BY LayoutGroupId",
        {"id": gid},
    ) == [("same",)]


def test_bad_sql_is_a_one_line_error(clickhouse: ClickHouse) -> None:
    with pytest.raises(ClickHouseError) as caught:
        clickhouse.rows("SELECT * FROM pin_dev_stats.no_such_table")
    assert "no_such_table" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_unreachable_server_is_a_clear_error() -> None:
    port = free_port()  # nothing listens there
    with (
        open_clickhouse(f"clickhouse://default@127.0.0.1:{port}") as ch,
        pytest.raises(ClickHouseUnavailable) as caught,
    ):
        ch.rows("SELECT 1")
    assert f"ClickHouse server at 127.0.0.1:{port} is unreachable" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_second_process_on_the_embedded_folder_gets_a_clear_error(chdb_url: str) -> None:
    """This test process holds the session's folder; another process must fail fast and clearly."""
    probe = (
        "import sys\n"
        "from pin_pipelines.clickhouse import open_clickhouse\n"
        "from pin_pipelines.errors import PinError\n"
        "try:\n"
        f"    open_clickhouse({chdb_url!r})\n"
        "except PinError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    folder = chdb_url.removeprefix("chdb://")
    assert result.returncode == 3, result.stdout + result.stderr
    message = result.stdout.strip()
    assert message == (
        f"embedded ClickHouse folder {folder} is in use by process {os.getpid()}; chdb allows one "
        "process per folder: wait for it or stop it, or point PIN_CLICKHOUSE_URL at another "
        "chdb:// folder or a clickhouse:// server"
    )
    assert "Traceback" not in result.stderr


def test_second_folder_in_the_same_process_is_a_clear_error(chdb_url: str, tmp_path: Path) -> None:
    with pytest.raises(ClickHouseError) as caught:
        open_clickhouse(f"chdb://{tmp_path / 'other'}")
    assert str(caught.value).startswith(
        f"this process already has embedded ClickHouse open at {chdb_url.removeprefix('chdb://')}"
    )


def test_local_server_up_is_idempotent_and_down_stops_it(
    private_clickhouse_server: LocalClickHouseServer,
) -> None:
    again = private_clickhouse_server.up()
    assert again["state"] == "already running"
    assert again["version"] == "18.16.1"
    assert private_clickhouse_server.status()["state"] == "running"
    with open_clickhouse(server_url(private_clickhouse_server)) as ch:
        assert ch.rows("SELECT 1") == [(1,)]
    assert private_clickhouse_server.down()["state"] == "stopped"
    assert private_clickhouse_server.down()["state"] == "not running"
    assert private_clickhouse_server.status()["state"] == "down"


def test_url_must_name_the_contract_database() -> None:
    with pytest.raises(PinError) as caught:
        open_clickhouse("clickhouse://default@127.0.0.1:9000/other")
    assert str(caught.value) == (
        "PIN_CLICKHOUSE_URL names database 'other'; the tables live in 'pin_dev_stats'"
    )
