"""The embedded engine (chdb): ClickHouse inside this process, data in one folder.

chdb lets one process at a time have a folder open (it holds a lock on `<folder>/status`) and one
folder at a time per process. A long-lived process opens the folder as its owner (`serve=True`,
the continuous loader) and answers the other processes' statements (`owner.py`); everyone else
sends its statements to the owner when one answers, and opens the folder itself otherwise. A
folder held by another process that serves nothing is a one-line PinError instead of chdb's
generic "Error initializing EmbeddedServer" (the real cause only reaches stderr), and so is a
second folder in one process.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from uuid import UUID

import chdb.session

from pin_pipelines.clickhouse import owner
from pin_pipelines.clickhouse.client import ClickHouse, ClickHouseError, ClickHouseUnavailable, Row
from pin_pipelines.clickhouse.literals import Param, literal, render
from pin_pipelines.errors import PinError

log = logging.getLogger("pin_pipelines.clickhouse")

_OTHER_FOLDER = re.compile(r"already initialized with path '([^']*)'")
#: How long an owner waits for a folder that a process serving nothing has open (a reader that
#: came while no owner ran: seconds), and anyone for an owner that is starting or handing over.
OPEN_WAIT = 60.0
#: How many times an owner tries a folder that chdb would not open without saying why (see
#: _become_owner); a folder that cannot be opened fails this many times in a row, at once.
UNEXPLAINED_OPEN_TRIES = 5


class EmbeddedClickHouse(ClickHouse):
    """The folder's session in this process, or a connection to the process that owns it.

    With `serve`, this process becomes the folder's owner when none answers: it waits (up to
    OPEN_WAIT) for the folder, opens it and answers other processes until `close`. When another
    owner answers (the run this one succeeds), it sends its statements there and takes the
    folder over as soon as that owner lets go of it, idle or not, so readers never find the
    folder without an owner for longer than its open takes. A process that has the folder open
    already shares its session (chdb) and serves nothing more.
    """

    def __init__(self, folder: Path, *, serve: bool = False) -> None:
        self.location = str(folder)
        self._folder = folder
        self._serve = serve
        self._session: chdb.session.Session | None = None
        self._owner: Connection | None = None  # the owning process, when not this one
        self._server: owner.OwnerServer | None = None
        self._owner_lock: int | None = None
        #: Held while a statement runs or the backend changes (a take-over, a close).
        self._switch = threading.RLock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        #: The owner lock, got by the watcher, not yet used; _claim guards the hand-off.
        self._pending_lock: int | None = None
        self._claim = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)
        with self._switch:
            self._attach()

    @property
    def serving(self) -> bool:
        """Whether this process owns the folder and answers others on its socket."""
        return self._server is not None

    def command(self, sql: str, params: Mapping[str, Param] | None = None) -> None:
        self._query(render(sql, params), "Null")

    def rows(self, sql: str, params: Mapping[str, Param] | None = None) -> list[Row]:
        return self._result(sql, params)[1]

    def records(self, sql: str, params: Mapping[str, Param] | None = None) -> list[dict[str, Any]]:
        names, rows = self._result(sql, params)
        return [dict(zip(names, row, strict=True)) for row in rows]

    def _result(self, sql: str, params: Mapping[str, Param] | None) -> tuple[list[str], list[Row]]:
        """The result's column names and its rows, in the driver's Python types."""
        result = json.loads(self._query(render(sql, params), "JSONCompact") or "{}")
        if not result:
            return [], []
        converters = [_converter(column["type"]) for column in result["meta"]]
        return [str(column["name"]) for column in result["meta"]], [
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
        """Stores the rows before it returns (chdb runs in this process, or the owner answers
        once they are stored). chdb has no insert API: the rows go inline as one JSON array of
        objects (JSONEachRow accepts it), which needs no SQL escaping and is encoded in one
        C-speed `json.dumps`.

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
            repeatable=False,
        )

    def close(self) -> None:
        """An owner first answers the statements in progress and refuses new ones (they go to
        the next owner), then closes the folder, then lets the next owner take it."""
        self._closed.set()
        with self._switch:
            if self._server is not None:
                self._server.stop()
                self._server = None
            if self._session is not None:
                self._session.close()
                self._session = None
            for lock in (self._owner_lock, self._take_pending_lock()):
                if lock is not None:
                    os.close(lock)
            self._owner_lock = None
            if self._owner is not None:
                self._owner.close()
                self._owner = None
        if self._watcher is not None:
            self._watcher.join()

    def _attach(self) -> None:
        """This process's session, the owner's connection, or (with `serve`) ownership."""
        folder = self._folder
        deadline = time.monotonic() + OPEN_WAIT
        while True:
            if _holder(folder) == _THIS_PROCESS:
                self._open_session()
                return
            self._owner = owner.connect(folder)
            if self._owner is not None:
                if self._serve and (self._watcher is None or not self._watcher.is_alive()):
                    self._watcher = threading.Thread(
                        target=self._take_over_when_free, name="pin-chdb-successor", daemon=True
                    )
                    self._watcher.start()
                return
            if self._serve:
                lock = self._take_pending_lock() or owner.take_owner_lock(folder)
                if lock is not None:
                    self._become_owner(lock, deadline)
                    return
            else:
                self._owner = owner.wait_for_owner(folder, deadline - time.monotonic())
                if self._owner is not None:
                    return
                if not owner.owner_lock_held(folder):
                    try:
                        self._open_session()  # no owner: the folder itself, or the busy error
                        return
                    except ClickHouseUnavailable:
                        # An owner that took the lock after the look above has the folder open
                        # and answers in a moment (a check run launched beside the load run
                        # failed here): wait for it. Held by a process that serves nothing: busy.
                        if not owner.owner_lock_held(folder):
                            raise
            if time.monotonic() > deadline:
                raise ClickHouseUnavailable(
                    f"embedded ClickHouse folder {folder}: its owner did not answer within "
                    f"{OPEN_WAIT:g}s ({owner.LOCK_NAME} is held)"
                )
            time.sleep(0.02)

    def _take_over_when_free(self) -> None:
        """While this process sends its statements to another owner: take the owner lock as soon
        as that owner releases it, and the folder with it (its statements come here next)."""
        while self._owner is not None and not self._closed.wait(0.01):
            lock = owner.take_owner_lock(self._folder)
            if lock is None:
                continue
            with self._claim:
                self._pending_lock = lock
            with self._switch:
                lock = self._take_pending_lock()
                if lock is None:  # a statement found the owner gone and took the folder first
                    return
                if self._closed.is_set():
                    os.close(lock)
                    return
                if self._owner is not None:
                    self._owner.close()
                    self._owner = None
                try:
                    self._become_owner(lock, time.monotonic() + OPEN_WAIT)
                except PinError as exc:  # the next statement attaches again
                    log.warning("embedded ClickHouse %s not taken over: %s", self._folder, exc)
            return

    def _take_pending_lock(self) -> int | None:
        with self._claim:
            lock, self._pending_lock = self._pending_lock, None
        return lock

    def _become_owner(self, lock: int, deadline: float) -> None:
        """Wait for the folder (a reader may have opened it while no owner ran: it holds it for
        its statement), open it, serve it.

        A reader that opened the folder before this process took the owner lock, and closed it
        again before the failed open was looked at, leaves an error that does not say it was
        busy (chdb prints its lock error to stderr and raises a bare "Error initializing"): a
        CI run's loader ended so, started while its test read the folder. That moment does not
        come back once the lock is held (readers then wait for the socket), so such an error
        is tried again a few times; one that repeats is the folder's own and ends the start."""
        unexplained = 0
        try:
            while self._session is None:
                try:
                    self._open_session()
                except ClickHouseUnavailable:  # busy: a reader that came while no owner ran
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
                except _UnexplainedOpenError:
                    unexplained += 1
                    if unexplained >= UNEXPLAINED_OPEN_TRIES or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            try:
                self._server = owner.OwnerServer(self._folder, self._run)
            except OSError as exc:
                raise ClickHouseError(
                    f"cannot serve embedded ClickHouse at {self._folder} on "
                    f"{owner.socket_path(self._folder)}: {exc}"
                ) from exc
        except BaseException:
            if self._session is not None:
                self._session.close()
                self._session = None
            os.close(lock)
            raise
        self._owner_lock = lock

    def _open_session(self) -> None:
        holder = _holder(self._folder)
        if holder not in (_FREE, _THIS_PROCESS):
            raise _busy(self._folder, holder)
        try:
            self._session = chdb.session.Session(str(self._folder))
        except RuntimeError as exc:
            raise _open_error(self._folder, exc) from exc

    def _run(self, sql: str, fmt: str) -> bytes:
        """A statement on this process's session (its own, or one an asking process sent)."""
        assert self._session is not None
        result = self._session.query(sql, fmt)
        return result.bytes() if result is not None else b""

    def _query(self, sql: str, fmt: str, *, repeatable: bool = True) -> str:
        """Run here, or in the owner. An owner that stops hands the statement back unrun (it goes
        to the next owner, or to the folder itself); one whose connection broke may have run it,
        so only a repeatable statement is sent again (an insert fails as unavailable: the
        loader's retry reads its guard before it inserts again)."""
        with self._switch:
            if self._closed.is_set():
                raise ClickHouseError(f"embedded ClickHouse at {self.location} is closed")
            if self._owner is None and self._session is None:  # a take-over that failed
                self._attach()
            while self._owner is not None:
                try:
                    return owner.ask(self._owner, sql, fmt).decode()
                except owner.StatementFailed as exc:
                    raise ClickHouseError(f"embedded ClickHouse at {self.location}: {exc}") from exc
                except owner.OwnerGone as exc:
                    self._owner.close()
                    self._owner = None
                    if exc.executed is None and not repeatable:
                        raise ClickHouseUnavailable(
                            f"embedded ClickHouse at {self.location}: {exc}; the statement may "
                            "or may not have run"
                        ) from exc
                    self._attach()
            try:
                return self._run(sql, fmt).decode()
            except RuntimeError as exc:
                text = str(exc).strip()
                first_line = text.splitlines()[0] if text else repr(exc)
                raise ClickHouseError(
                    f"embedded ClickHouse at {self.location}: {first_line}"
                ) from exc


_FREE = "free"
_THIS_PROCESS = "this process"


def _holder(folder: Path) -> str:
    """Who has the folder open: _FREE, _THIS_PROCESS, or "process 123" (another one).

    Probing first keeps chdb from printing its own lock error to stderr in the common case.
    """
    try:
        fd = os.open(folder / "status", os.O_RDONLY)
    except FileNotFoundError:
        return _FREE
    try:
        found = re.search(r"PID: (\d+)", os.read(fd, 256).decode(errors="replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if found and int(found.group(1)) == os.getpid():
                return _THIS_PROCESS  # chdb shares the open folder within a process
            return f"process {found.group(1)}" if found else "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return _FREE
    finally:
        os.close(fd)


def _busy(folder: Path, holder: str) -> ClickHouseUnavailable:
    return ClickHouseUnavailable(
        f"embedded ClickHouse folder {folder} is in use by {holder}; chdb allows one process per "
        "folder: wait for it or stop it, or point PIN_CLICKHOUSE_URL at another chdb:// folder "
        "or a clickhouse:// server"
    )


def _open_error(folder: Path, exc: RuntimeError) -> ClickHouseError | ClickHouseUnavailable:
    holder = _holder(folder)
    if holder not in (_FREE, _THIS_PROCESS):  # lost a race with another process opening it
        return _busy(folder, holder)
    other = _OTHER_FOLDER.search(str(exc))
    if other:
        return ClickHouseError(
            f"this process already has embedded ClickHouse open at {other.group(1)}; chdb serves "
            f"one folder per process, so {folder} cannot be opened until that one is closed"
        )
    return _UnexplainedOpenError(f"cannot open embedded ClickHouse at {folder}: {exc}")


class _UnexplainedOpenError(ClickHouseError):
    """chdb would not open the folder, and nothing says it was busy (see _become_owner)."""


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
