"""The exporter's one Collector: every scrape reads each source afresh.

A source that fails or is slow (PostgreSQL down, broker unreachable) drops only its own families
and reports `pin_metrics_source_up{source} 0`, so one outage neither blanks the whole scrape nor
hides behind stale numbers. Sources are read in parallel, each within SOURCE_TIMEOUT, so a scrape
answers well inside Prometheus' default 10 s scrape timeout even when a client library waits
longer (librdkafka's metadata timeout is 10 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.logs import log_event
from pin_pipelines.metrics import devstats, postgres

log = logging.getLogger("pin_pipelines.metrics")

#: Seconds a scrape waits for one source; a late read finishes in the background and is dropped.
SOURCE_TIMEOUT = 6.0


@dataclass(frozen=True)
class Source:
    """`collect` does the I/O and returns the families; `describe` returns them without samples."""

    name: str
    collect: Callable[[], list[Metric]]
    describe: Callable[[], list[Metric]]


def sources(settings: Settings) -> list[Source]:
    def pg() -> list[Metric]:
        with connection(settings.pg_dsn, autocommit=True) as conn:
            return postgres.families(postgres.read_state(conn))

    return [
        Source("postgres", pg, lambda: postgres.families(None)),
        Source(
            "kafka",
            lambda: devstats.families(devstats.read_kafka_state(settings)),
            lambda: devstats.families(None),
        ),
    ]


class PinCollector(Collector):
    def __init__(self, sources: list[Source], timeout: float = SOURCE_TIMEOUT) -> None:
        self.sources = sources
        self.timeout = timeout
        # Enough workers for two overlapping scrapes of sources that all hang.
        self._pool = ThreadPoolExecutor(2 * len(sources) or 1, thread_name_prefix="pin-metrics")

    def collect(self) -> Iterator[Metric]:
        up = _source_family("pin_metrics_source_up", "1 when the source answered this scrape.")
        took = _source_family(
            "pin_metrics_source_duration_seconds", "Time this scrape spent reading the source."
        )
        started = time.monotonic()
        pending = [(source, self._pool.submit(source.collect)) for source in self.sources]
        for source, future in pending:
            families = self._result(source, future, deadline=started + self.timeout)
            up.add_metric([source.name], 1.0 if families else 0.0)
            took.add_metric([source.name], time.monotonic() - started)
            yield from families
        yield up
        yield took

    @staticmethod
    def _result(source: Source, future: Future[list[Metric]], deadline: float) -> list[Metric]:
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            error = "did not answer in time"
        except Exception as exc:  # any failure of a source must not fail the scrape
            error = f"{type(exc).__name__}: {exc}"
        log_event(
            log, "metrics_source_failed", level=logging.WARNING, source=source.name, error=error
        )
        return []

    def describe(self) -> Iterator[Metric]:
        """Every family the exporter serves, without touching any service."""
        for source in self.sources:
            yield from source.describe()
        yield _source_family("pin_metrics_source_up", "")
        yield _source_family("pin_metrics_source_duration_seconds", "")


def _source_family(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["source"])
