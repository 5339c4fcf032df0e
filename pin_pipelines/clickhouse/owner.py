"""An embedded ClickHouse folder's owner answers the other processes' statements.

chdb admits one process per data folder (a lock on `<folder>/status`). A process can close its
session and let another one in, but each open costs 20–110 ms and leaks about five threads and
1.7 MB that the close does not give back (measured with chdb 4.4: docs/clickhouse.md, "The
embedded engine"),
so the continuous loader cannot let go of the folder between its batches. Instead the loader
opens the folder as its *owner* (`open_clickhouse(url, serve=True)`): it keeps it for its whole
run and answers every other process's statements — `pin devstats labels`, the drift asset, the
checks, a `--once` load, its own successor during a hand-over — on a unix socket in the folder,
on the session it holds (a chdb session is thread-safe and releases the GIL while it queries).
A reader waits at most for the statement in progress, never for a whole run.

Hand-written on purpose: chdb is clickhouse-local as a library and has no server of its own, and
the HTTP servers built around chdb are programs that would own the folder themselves, i.e. a
ClickHouse server, which the project supports already (`PIN_CLICKHOUSE_URL=clickhouse://…`). The
socket and the message framing are the standard library's (`multiprocessing.connection`); the
protocol is a JSON header per message, plus the result's bytes.

Who may take the folder is settled by a second lock, `<folder>/pin-owner.lock` (flock, released
by the kernel when its process dies): held by an owner from before it opens the folder until
after it closed it. A process that finds no owner answering while that lock is held waits for
the socket (an owner is starting, or handing over) instead of opening the folder itself.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

log = logging.getLogger("pin_pipelines.clickhouse")

SOCKET_NAME = "pin-owner.sock"
LOCK_NAME = "pin-owner.lock"
#: How long a statement may take in the owner before the asking process gives up on it.
STATEMENT_TIMEOUT = 300.0
#: How often an owner's connection threads look whether the owner is stopping.
_IDLE_CHECK = 0.2


class OwnerGone(Exception):
    """The owner stopped or died. `executed` is False when it said it did not run the
    statement (it was stopping), None when nobody can tell (the connection broke)."""

    def __init__(self, why: str, executed: bool | None) -> None:
        super().__init__(why)
        self.executed = executed


class StatementFailed(Exception):
    """The owner ran the statement and ClickHouse rejected it (the first line of its error)."""


def socket_path(folder: Path) -> Path:
    return folder / SOCKET_NAME


def connect(folder: Path) -> Connection | None:
    """A connection to the folder's owner, or None when no owner answers."""
    try:
        return Client(str(socket_path(folder)), family="AF_UNIX")
    except OSError:  # no socket file, nobody listening on it, or a path too long for a socket
        return None


def ask(conn: Connection, sql: str, fmt: str, timeout: float = STATEMENT_TIMEOUT) -> bytes:
    """Run one statement in the owner: its result in `fmt`, StatementFailed, or OwnerGone."""
    try:
        if conn.poll(0):  # the owner said goodbye (or died) while this connection idled
            _answer_header(conn)
        conn.send_bytes(json.dumps({"sql": sql, "format": fmt}).encode())
    except (EOFError, OSError) as exc:  # nothing of it was read: the owner is gone
        raise OwnerGone(f"the owner is gone ({exc or type(exc).__name__})", executed=False) from exc
    try:
        if not conn.poll(timeout):
            raise OwnerGone(f"no answer within {timeout:g}s", executed=None)
        _answer_header(conn)
        return conn.recv_bytes()
    except ConnectionResetError as exc:
        # A unix socket is reset when its peer closes it with data unread: the owner stopped
        # (its `retry` discarded by the reset) or died before it read the whole statement.
        raise OwnerGone("the owner stopped before reading the statement", executed=False) from exc
    except (EOFError, OSError) as exc:
        why = f"the owner's connection broke ({exc or type(exc).__name__})"
        raise OwnerGone(why, executed=None) from exc


def _answer_header(conn: Connection) -> None:
    header = json.loads(conn.recv_bytes())
    if "retry" in header:
        raise OwnerGone(str(header["retry"]), executed=False)
    if "error" in header:
        raise StatementFailed(str(header["error"]))


def owner_lock_held(folder: Path) -> bool:
    """Whether a process holds (or is taking) the folder as its owner."""
    fd = _try_lock(folder)
    if fd is None:
        return True
    os.close(fd)  # closing releases the probe's lock
    return False


def take_owner_lock(folder: Path) -> int | None:
    """The owner lock's descriptor (held until closed), or None when another process has it."""
    return _try_lock(folder)


def _try_lock(folder: Path) -> int | None:
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class OwnerServer:
    """Answers statements on `<folder>/pin-owner.sock` with `run(sql, fmt)`, a thread per
    connection, until `stop`. A statement received while stopping is answered with `retry`
    (not run), so the asking process may send it to the next owner, inserts included."""

    def __init__(self, folder: Path, run: Callable[[str, str], bytes]) -> None:
        self._run = run
        self._address = str(socket_path(folder))
        # A socket file left by an owner that died: this process holds the owner lock now.
        socket_path(folder).unlink(missing_ok=True)
        self._listener = Listener(self._address, family="AF_UNIX", backlog=16)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, name="pin-chdb-owner", daemon=True)
        self._accepting.start()

    def stop(self) -> None:
        """Let the statements in progress finish and answer, refuse new ones, then close."""
        self._stopping.set()
        wake = connect(Path(self._address).parent)  # the accept loop sees the flag
        if wake is not None:
            wake.close()
        self._accepting.join()
        for thread in list(self._threads):
            thread.join()
        self._listener.close()  # removes the socket file

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._listener.accept()
            except OSError as exc:  # not expected; the readers fall back to waiting
                log.warning("embedded ClickHouse owner stopped accepting: %s", exc)
                return
            if self._stopping.is_set():
                conn.close()
                return
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="pin-chdb-statement", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                while True:
                    if conn.poll(_IDLE_CHECK):
                        request = json.loads(conn.recv_bytes())
                        if not self._stopping.is_set():
                            self._answer(conn, str(request["sql"]), str(request["format"]))
                            continue
                    if self._stopping.is_set():
                        _send_header(conn, {"retry": "the embedded ClickHouse owner stopped"})
                        return
            except (EOFError, OSError):
                return  # the asking process closed its connection (or died)

    def _answer(self, conn: Connection, sql: str, fmt: str) -> None:
        try:
            result = self._run(sql, fmt)
        except RuntimeError as exc:
            text = str(exc).strip()
            _send_header(conn, {"error": text.splitlines()[0] if text else repr(exc)})
            return
        _send_header(conn, {"ok": True})
        conn.send_bytes(result)


def _send_header(conn: Connection, header: dict[str, object]) -> None:
    conn.send_bytes(json.dumps(header).encode())


def wait_for_owner(folder: Path, seconds: float) -> Connection | None:
    """While another process holds the owner lock (starting, or handing over): its connection,
    as soon as it answers; None when the lock is free again or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        conn = connect(folder)
        if conn is not None:
            return conn
        if not owner_lock_held(folder):
            return None
        time.sleep(0.02)
    return None
