"""A loopback TCP relay in front of a real server that can lose the server's answers: a network
fault between two real parts, not a fake of either."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable


class AnswerCutter:
    """Forwards 127.0.0.1:`port` to `upstream_port`. After `lose_answers(after_seconds)`, the
    server's bytes on the connections open then are dropped, and those connections are closed
    `after_seconds` later: the client has sent everything and never hears back. New connections
    pass again. Every byte the clients sent is kept in `sent` (what went over the wire: a
    native-protocol query's text is sent as it is)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sent = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_answers(self, after_seconds: float) -> None:
        with self._lock:
            cut, self._open = self._open, []
        for _, _, deaf in cut:
            deaf.set()

        def close_later() -> None:
            time.sleep(after_seconds)
            for client, server, _ in cut:
                _hang_up(client)
                _hang_up(server)

        threading.Thread(target=close_later, daemon=True).start()

    def close(self) -> None:
        _hang_up(self._listener)
        with self._lock:
            for client, server, _ in self._open:
                _hang_up(client)
                _hang_up(server)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            deaf = threading.Event()
            with self._lock:
                self._open.append((client, server, deaf))
            threading.Thread(
                target=_pump, args=(client, server, None, self._record), daemon=True
            ).start()
            threading.Thread(target=_pump, args=(server, client, deaf), daemon=True).start()

    def _record(self, data: bytes) -> None:
        with self._lock:
            self.sent += data


def _pump(
    source: socket.socket,
    sink: socket.socket,
    deaf: threading.Event | None,
    record: Callable[[bytes], None] | None = None,
) -> None:
    """Copies until either side closes, then closes the other (a server waits for its clients
    to go before it shuts down)."""
    try:
        while data := source.recv(65536):
            if record is not None:
                record(data)
            if deaf is None or not deaf.is_set():
                sink.sendall(data)
    except OSError:
        pass
    finally:
        _hang_up(sink)


def _hang_up(sock: socket.socket) -> None:
    """shutdown, not just close: it sends the FIN and wakes a recv blocked on the socket."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
