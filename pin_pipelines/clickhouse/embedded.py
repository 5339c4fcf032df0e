"""The embedded engine (chdb): ClickHouse inside this process, data in one folder.

chdb lets one process at a time own a folder (it holds a lock on `<folder>/status`) and one folder
per process. Both conflicts become a one-line PinError instead of chdb's generic "Error initializing
EmbeddedServer" (the real cause only reaches stderr).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import chdb.session

from pin_pipelines.clickhouse.client import ClickHouse, ClickHouseError, ClickHouseUnavailable, Row
from pin_pipelines.clickhouse.literals import Param, literal, render

_OTHER_FOLDER = re.compile(r"already initialized with path '([^']*)'")


class EmbeddedClickHouse(ClickHouse):
    def __init__(self, folder: Path) -> None:
        self.location = str(folder)
        folder.mkdir(parents=True, exist_ok=True)
        holder = _other_process_holding(folder)
        if holder is not None:
            raise _busy(folder, holder)
        try:
            self._session = chdb.session.Session(str(folder))
        except RuntimeError as exc:
            raise _open_error(folder, exc) from exc

    def command(self, sql: str, params: Mapping[str, Param] | None = None) -> None:
        self._query(render(sql, params), "Null")

    def rows(self, sql: str, params: Mapping[str, Param] | None = None) -> list[Row]:
        result = json.loads(self._query(render(sql, params), "JSONCompact") or "{}")
        if not result:
            return []
        converters = [_converter(column["type"]) for column in result["meta"]]
        return [
            tuple(convert(value) for convert, value in zip(converters, row, strict=True))
            for row in result["data"]
        ]

    def send_insert(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        dedup_token: str | None = None,
    ) -> None:
        """Stores the rows before it returns (chdb runs in this process). chdb has no insert
        API: the rows go inline as one JSON array of objects (JSONEachRow accepts it), which
        needs no SQL escaping and is encoded in one C-speed `json.dumps`.

        Times are sent as ISO-8601 with their offset and parsed best-effort, so the stored instant
        does not depend on the process's time zone.
        """
        if not rows:
            return
        settings = "date_time_input_format = 'best_effort'"
        if dedup_token is not None:
            settings += f", insert_deduplication_token = {literal(dedup_token)}"
        payload = json.dumps(
            [
                {column: _plain(value) for column, value in zip(columns, row, strict=True)}
                for row in rows
            ],
            ensure_ascii=False,
        )
        self._query(
            f"INSERT INTO {table} ({', '.join(columns)}) SETTINGS {settings} "
            f"FORMAT JSONEachRow {payload}",
            "Null",
        )

    def close(self) -> None:
        self._session.close()

    def _query(self, sql: str, fmt: str) -> str:
        try:
            result = self._session.query(sql, fmt)
        except RuntimeError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ClickHouseError(f"embedded ClickHouse at {self.location}: {first_line}") from exc
        return result.bytes().decode() if result is not None else ""


def _other_process_holding(folder: Path) -> str | None:
    """Who holds the folder's lock, when it is another process ("process 123"); else None.

    Probing first keeps chdb from printing its own lock error to stderr in the common case.
    """
    try:
        fd = os.open(folder / "status", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        found = re.search(r"PID: (\d+)", os.read(fd, 256).decode(errors="replace"))
        if found and int(found.group(1)) == os.getpid():
            return None  # this process already has the folder open: chdb shares it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"process {found.group(1)}" if found else "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _busy(folder: Path, holder: str) -> ClickHouseUnavailable:
    return ClickHouseUnavailable(
        f"embedded ClickHouse folder {folder} is in use by {holder}; chdb allows one process per "
        "folder: wait for it or stop it, or point PIN_CLICKHOUSE_URL at another chdb:// folder "
        "or a clickhouse:// server"
    )


def _open_error(folder: Path, exc: RuntimeError) -> ClickHouseError | ClickHouseUnavailable:
    holder = _other_process_holding(folder)
    if holder is not None:  # lost a race with another process opening the same folder
        return _busy(folder, holder)
    other = _OTHER_FOLDER.search(str(exc))
    if other:
        return ClickHouseError(
            f"this process already has embedded ClickHouse open at {other.group(1)}; chdb serves "
            f"one folder per process, so {folder} cannot be opened until that one is closed"
        )
    return ClickHouseError(f"cannot open embedded ClickHouse at {folder}: {exc}")


def _converter(ch_type: str) -> Callable[[Any], Any]:
    """JSON value → the Python type clickhouse-driver returns for the same column type."""
    base = re.sub(r"^(Nullable|LowCardinality)\((.*)\)$", r"\2", ch_type)
    convert: Callable[[Any], Any]
    if base == "UUID":
        convert = UUID
    elif base.startswith(("Int", "UInt")):
        convert = int
    elif base.startswith("Float"):
        convert = float
    elif base.startswith("DateTime"):
        convert = datetime.fromisoformat
    elif base.startswith("Date"):
        convert = date.fromisoformat
    elif base.startswith("Tuple"):
        convert = tuple
    else:
        return lambda value: value
    return lambda value: None if value is None else convert(value)


def _plain(value: object) -> object:
    """A value JSON can encode as ClickHouse parses it."""
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, date):  # datetime included
        return value.isoformat()
    return value
