"""Every request of the read API logged (one JSON line with its actor) and counted.

The API is a process of its own that answers requests itself, so unlike the pipelines (counted
in PostgreSQL rows and served by `pin metrics serve`) it counts in memory (`ApiMetrics`) and
serves its own `/metrics` (prometheus-client's text format): `devstats_api_requests_total{status}`,
`devstats_api_request_duration_seconds{route}` and the process's own `process_*`. They are served
on a listener of their own, PIN_API_ADDR:PIN_API_METRICS_PORT (`server.serve_metrics`, no token),
not on the API's port, where `/metrics` is a path like any other the API does not have (a 401
without a valid token). A restart starts the counters from zero, which Prometheus' `rate()`
expects of a counter.

The middleware is plain ASGI (no BaseHTTPMiddleware task per request): it reads the status
from the response's first message, and the actor and the error the handlers left in the
request's state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pin_pipelines.devstats import Actor
from pin_pipelines.errors import first_line
from pin_pipelines.logs import log_event

log = logging.getLogger("pin_pipelines.api")

#: The `route` label: the API's paths, everything else `other` (a bounded label set whatever
#: paths a scanner tries).
ROUTES = {
    "/v1/layout-groups/labels": "labels",
    "/v1/layout-groups": "groups",
    "/healthz": "healthz",
    "/openapi.json": "openapi",
}
#: Seconds; a labels read of 100 ids takes a few milliseconds (docs/benchmarks.md).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ApiMetrics:
    """The API's own registry (not prometheus-client's global one: each app has its own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "devstats_api_requests",
            "Requests the dev-stats read API answered, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "devstats_api_request_duration_seconds",
            "Time from a request's arrival to its answer's start, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)

    def observe(self, status: int, route: str, seconds: float) -> None:
        self.requests.labels(str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The body and content type of a `/metrics` answer (the metrics listener's, as
        prometheus-client's server writes it; for tests and tools that read it in-process)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestLog:
    """ASGI middleware: one `api_request` line and one count per HTTP request."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500  # what the client sees if the app fails before it answers
        answered_at: float | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status, answered_at
            if message["type"] == "http.response.start":
                status, answered_at = int(message["status"]), time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:  # answered 500 by the outermost middleware, after this line
            state["error"] = f"internal error: {type(exc).__name__}: {first_line(exc)}"
            raise
        finally:
            seconds = (answered_at or time.perf_counter()) - started
            route = ROUTES.get(scope["path"], "other")
            self.metrics.observe(status, route, seconds)
            actor: Actor | None = state.get("actor")
            log_event(
                log,
                "api_request",
                method=scope["method"],
                route=route,
                path=scope["path"][:200],
                status=status,
                ms=round(seconds * 1000, 2),
                developer_id=actor.developer_id if actor else None,
                subject=actor.subject if actor else None,
                ids=state.get("ids"),
                error=state.get("error"),
            )
