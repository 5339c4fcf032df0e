"""`pin metrics serve`: the HTTP side of the exporter (prometheus-client's threaded server)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from pin_pipelines.config import DEFAULT_METRICS_ADDR, Settings
from pin_pipelines.db import connect
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import check_broker
from pin_pipelines.logs import log_event
from pin_pipelines.metrics.collector import PinCollector, sources
from pin_pipelines.signals import stop_requested
from pin_pipelines.worker import check_services

log = logging.getLogger("pin_pipelines.metrics")

# Loopback unless told otherwise: PIN_METRICS_ADDR=0.0.0.0 lets a remote Prometheus scrape.
DEFAULT_ADDR = DEFAULT_METRICS_ADDR
STOP_POLL_SECONDS = 0.2  # how soon SIGTERM/SIGINT stops the exporter


def registry_for(settings: Settings) -> CollectorRegistry:
    """A registry with only our collector: no process metrics of the exporter itself, whose
    counters would describe the exporter, not the pipelines."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PinCollector(sources(settings)))
    return registry


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(settings: Settings, port: int, addr: str = DEFAULT_ADDR) -> MetricsServer:
    """Serve /metrics in a background thread (port 0: any free port, see `.port`)."""
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry_for(settings))
    except OSError as exc:
        raise PinError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc
    return MetricsServer(server, thread)


def serve_metrics(settings: Settings, port: int | None = None, addr: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then close the socket and return (exit status 0).

    Its sources (PostgreSQL, Kafka) are checked first: an exporter started against a wrong
    PIN_PG_DSN or PIN_KAFKA_BOOTSTRAP fails now, with one line, instead of serving
    `pin_metrics_source_up 0` forever. Later outages of any source are reported per scrape.
    The signals are handled here, not left to Python's defaults, which an inherited SIG_IGN
    disables (see pin_pipelines.signals); the main thread polls the flag, since a handler must
    not take the locks a waiting `threading.Event` holds.
    """
    stopping = stop_requested()
    check_services(
        "the metrics exporter",
        [
            lambda: connect(settings.pg_dsn).close(),
            lambda: check_broker(settings.kafka_bootstrap),
        ],
    )
    bind = addr or settings.metrics_addr
    metrics = start_metrics_server(settings, settings.metrics_port if port is None else port, bind)
    log_event(log, "metrics_serving", url=f"http://{bind}:{metrics.port}/metrics")
    try:
        while not stopping():
            time.sleep(STOP_POLL_SECONDS)
    finally:
        metrics.close()
