"""Prometheus metrics of pin-pipelines, served by one exporter: `pin metrics serve`.

Drains, relays and loaders are short-lived processes, so nothing here counts in memory: gauges
are computed from PostgreSQL and Kafka state at scrape time, and counters are rows that the work
updates in its own transaction (written by the domain that counts: `recalc.counters`,
`devstats.counters`; this package only reads them). Any number of exporters serve the same
numbers, and a restart of any process loses nothing.

The exporter is imported lazily, so importing this package loads none of the Kafka and
ClickHouse clients it serves from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pin_pipelines.config import Settings


def serve_metrics(settings: Settings, port: int, addr: str | None = None) -> None:
    """Serve /metrics on `addr:port` until interrupted (see `server.serve_metrics`)."""
    from pin_pipelines.metrics.server import serve_metrics as serve

    serve(settings, port=port, addr=addr)
