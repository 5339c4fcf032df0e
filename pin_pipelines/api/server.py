"""`pin api serve`: the read API on uvicorn until SIGTERM/SIGINT (CONTRACT section 7).

Before it listens it has fetched the JWKS and read the dimension once, so a wrong setting or an
unreachable provider or ClickHouse ends the command at once with one line, not with a service
that answers 401 or 503 to everyone. It binds its socket itself (an address in use is one line
too) and runs uvicorn in a thread: the main thread keeps the project's SIGTERM/SIGINT handling
(`signals.py`, whatever dispositions the process inherited) and refreshes the keys that have
grown old (`JwksCache.refresh_if_stale`). On a stop signal uvicorn stops accepting, finishes the
requests in flight (at most GRACEFUL_SECONDS) and the command exits 0.

Its Prometheus `/metrics` (observe.py's `ApiMetrics`) has a listener of its own,
PIN_API_ADDR:PIN_API_METRICS_PORT (prometheus-client's `start_http_server`, in its thread, no
token), so that every request to the API's port but /healthz and /openapi.json needs one
(CONTRACT section 7). It starts before `api_serving` (a port in use is one line as well) and
closes on the stop, with uvicorn.
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time
from wsgiref.simple_server import WSGIServer

import h11
import uvicorn
from prometheus_client import start_http_server
from uvicorn.protocols.http.h11_impl import H11Protocol

from pin_pipelines.api.app import create_app
from pin_pipelines.api.auth import TokenVerifier
from pin_pipelines.api.jwks import JwksCache
from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.api.params import MAX_QUERY_BYTES
from pin_pipelines.api.pool import ClickHousePool
from pin_pipelines.config import Settings
from pin_pipelines.devstats import readable
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.logs import log_event
from pin_pipelines.signals import stop_requested

log = logging.getLogger("pin_pipelines.api")

#: How soon SIGTERM/SIGINT is seen, and how often stale keys are looked for.
STOP_POLL_SECONDS = 0.2
#: Requests in flight at a stop get this long to finish.
GRACEFUL_SECONDS = 10
#: uvicorn's bound on a request's head (request line and headers, h11's incomplete event size):
#: room for the longest query string the API reads (params.MAX_QUERY_BYTES, refused above that
#: with the API's own message) and ordinary headers; a longer head is refused by the server.
MAX_REQUEST_HEAD_BYTES = 2 * MAX_QUERY_BYTES
#: How long uvicorn may take to start serving on the bound socket.
START_SECONDS = 10.0


def serve_api(settings: Settings) -> None:
    """Check the keys and the dimension, listen, serve until SIGTERM/SIGINT (module docstring)."""
    stopping = stop_requested()
    verifier = TokenVerifier(
        JwksCache(_required(settings.api_jwks_url, "PIN_API_JWKS_URL")),
        issuer=_required(settings.api_issuer, "PIN_API_ISSUER"),
        audience=_required(settings.api_audience, "PIN_API_AUDIENCE"),
    )
    keys = verifier.keys.load()
    with ClickHousePool(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as pool:
        try:
            with pool.client() as ch:
                readable(ch)
        except PinError as exc:
            raise PinError(f"the dimension cannot be read ({first_line(exc)})") from exc
        metrics = ApiMetrics()
        server = uvicorn.Server(_config(create_app(pool, verifier, metrics)))
        listener = _listen(settings.api_addr, settings.api_port)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [listener]}, name="pin-api-server", daemon=True
        )
        scraped: WSGIServer | None = None
        try:
            scraped = serve_metrics(metrics, settings.api_addr, settings.api_metrics_port)
            thread.start()
            _wait_until_started(server, thread)
            # Everything the process holds once it serves (FastAPI, pydantic, the driver, ~60,000
            # objects) is moved out of the collector's sight: a full collection of it took ~18 ms,
            # a pause of every request in flight, and the read threads' allocations trigger one
            # now and then. Requests' own garbage is young and is collected as before.
            gc.collect()
            gc.freeze()
            host = _host(settings.api_addr)
            log_event(
                log,
                "api_serving",
                url=f"http://{host}:{listener.getsockname()[1]}",
                metrics_url=f"http://{host}:{scraped.server_port}/metrics",
                clickhouse=pool.location,
                jwks_keys=keys,
            )
            while not stopping():
                if not thread.is_alive():
                    raise PinError("the API server stopped by itself (see the log lines above)")
                verifier.keys.refresh_if_stale()
                time.sleep(STOP_POLL_SECONDS)
        finally:
            server.should_exit = True
            if scraped is not None:  # its loop polls every 0.5 s, while uvicorn stops
                scraped.shutdown()
                scraped.server_close()
            if thread.is_alive():
                thread.join(GRACEFUL_SECONDS + 5)
            listener.close()
    log_event(log, "api_stopped", requests=server.server_state.total_requests)


def _required(value: str | None, name: str) -> str:
    if not value:
        raise PinError(
            f"{name} is not set: `pin api serve` needs PIN_API_JWKS_URL, "
            "PIN_API_ISSUER and PIN_API_AUDIENCE (README, Settings)"
        )
    return value


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _listen(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        return socket.create_server((addr, port), family=family, backlog=2048)
    except OSError as exc:
        raise PinError(f"cannot listen on {_host(addr)}:{port}: {exc.strerror or exc}") from exc


def serve_metrics(metrics: ApiMetrics, addr: str, port: int) -> WSGIServer:
    """`metrics`' registry served on `addr:port` (0: a free port, see `.server_port`) by
    prometheus-client's own server, in a daemon thread; `shutdown()` and `server_close()` stop
    it. An address in use is one line, like the API's port."""
    try:
        scraped, _ = start_http_server(port, addr, registry=metrics.registry)
    except OSError as exc:
        raise PinError(
            f"cannot listen on {_host(addr)}:{port} for /metrics "
            f"(PIN_API_METRICS_PORT): {exc.strerror or exc}"
        ) from exc
    return scraped


def _config(app: object) -> uvicorn.Config:
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [_ServerLogLines()] if name == "uvicorn" else []
        logger.setLevel(logging.WARNING)
        logger.propagate = name != "uvicorn"
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_config=None,
        access_log=False,  # RequestLog writes one line per request, with its actor
        lifespan="off",
        server_header=False,
        proxy_headers=False,  # nothing here trusts X-Forwarded-*: the actor is the token's
        http=_JsonErrorsH11,
        # uvloop, not asyncio's own loop (uvicorn's "auto" picks it when installed, and a pyproject
        # dependency makes sure it is): with asyncio's, 200 labels requests/s of bench_api's
        # load saturated the process (p50 2.6 s, 2.2-2.3 ms of CPU per request; uvloop: 3.7 ms
        # and 1.8 ms).
        loop="uvloop",
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
        backlog=2048,
    )


def _wait_until_started(server: uvicorn.Server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise PinError("the API server did not start (see the log lines above)")
        time.sleep(0.01)


class _JsonErrorsH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with its own 400 (a request h11 cannot parse, or whose head
    is longer than MAX_REQUEST_HEAD_BYTES) in the API's error form."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": "invalid HTTP request (malformed, or its head too long)"})
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body.encode()),
            h11.EndOfMessage(),
        ):
            output = self.conn.send(event)
            if output:
                self.transport.write(output)
        self.transport.close()


class _ServerLogLines(logging.Handler):
    """uvicorn's own warnings and errors as the project's JSON lines, one line each (an
    exception's first line, never its traceback)."""

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage().strip()
        log_event(
            log,
            "api_server_log",
            level=record.levelno,
            source=record.name,
            message=message.splitlines()[0] if message else "",
            error=first_line(error) if error else None,
        )
