"""Traces: a span per drain tick (its correlation id) and per project (ProjectId, TenantId,
LastReason), per relay batch and per loader batch (spec 000, "Traces").

OpenTelemetry's SDK does the work; this module only decides, once per process, whether to
install an exporting TracerProvider, from the standard variables alone: `OTEL_TRACES_EXPORTER`
(`otlp`, `console` or `none`), or, when it is unset, an OTLP endpoint variable. Without either
the API's no-op tracer stays, and nothing leaves the process. Endpoint, headers, timeout,
service name, resource attributes and batching are read by the SDK from their own standard
variables. OTLP goes over HTTP (`http/protobuf`, the OTLP default for this exporter); `grpc` is
refused with a clear error rather than dropped in silence.

A project span's context travels with its snapshot events as a W3C `traceparent` (an outbox
column, then a Kafka header), so the loader's batch span links back to the recalc that caused it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from functools import cache

from opentelemetry import propagate, trace

from pin_pipelines.errors import PinError

TRACER_NAME = "pin_pipelines"
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def exporter_name(env: Mapping[str, str]) -> str:
    """Which exporter the environment asks for: `otlp`, `console` or `none`."""
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not named:
        return "otlp" if any(env.get(v, "").strip() for v in OTLP_ENDPOINT_VARIABLES) else "none"
    if named not in ("otlp", "console", "none"):
        raise PinError(f"OTEL_TRACES_EXPORTER={named} is not supported here: otlp, console or none")
    if named == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        if protocol.strip().lower() != "http/protobuf":
            raise PinError(
                f"OTLP protocol {protocol} is not supported here: set"
                " OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
            )
    return named


#: Links per batch span at most: a batch of 1,000 events links back to at most this many recalcs.
MAX_LINKS = 128


@cache
def tracing_enabled() -> bool:
    """Whether this process exports traces: per-message work for spans is skipped otherwise."""
    return exporter_name(os.environ) != "none"


@cache
def tracer() -> trace.Tracer:
    """The process's tracer, its provider installed at the first call."""
    if tracing_enabled():
        name = exporter_name(os.environ)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )

        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        class ReservedSpanIds(RandomIdGenerator):
            """Random ids, but a span recorded after its work (record_child_span) gets the id
            reserved for it (child_traceparents)."""

            def generate_span_id(self) -> int:
                reserved = _RESERVED_SPAN_ID.get()
                return super().generate_span_id() if reserved is None else reserved

        # The provider flushes and shuts its exporter down at interpreter exit.
        provider = TracerProvider(resource=Resource.create(), id_generator=ReservedSpanIds())
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    return trace.get_tracer(TRACER_NAME)


#: The span id record_child_span is starting a span with (ReservedSpanIds).
_RESERVED_SPAN_ID: ContextVar[int | None] = ContextVar("reserved_span_id", default=None)


def child_traceparents(count: int) -> list[str] | None:
    """W3C traceparents for `count` spans to come, children of the current span, their ids
    chosen now; None when nothing is traced. For work that runs on the server before its span
    can exist (a recalc_tick call) yet must stamp the span's context into what it writes (the
    events): the span is recorded afterwards with its id (record_child_span)."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    prefix, flags = f"00-{context.trace_id:032x}-", f"-{context.trace_flags:02x}"
    return [f"{prefix}{random.getrandbits(64) or 1:016x}{flags}" for _ in range(count)]


def record_child_span(
    name: str,
    traceparent: str | None,
    *,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, str | int],
) -> None:
    """A finished span, child of the current one, with the id that `traceparent` (from
    child_traceparents) reserved for it and the work's own start and end; nothing when
    `traceparent` is None (nothing is traced)."""
    if traceparent is None:
        return
    token = _RESERVED_SPAN_ID.set(int(traceparent.split("-")[2], 16))
    try:
        span = tracer().start_span(name, attributes=attributes, start_time=start_ns)
    finally:
        _RESERVED_SPAN_ID.reset(token)
    span.end(end_time=end_ns)


def links_to(traceparents: Iterable[str | bytes]) -> list[trace.Link]:
    """Links to the spans the traceparents name (the events' origins), each once, at most
    MAX_LINKS; a malformed one is skipped, never worth failing a batch for."""
    links: dict[tuple[int, int], trace.Link] = {}
    for traceparent in traceparents:
        text = traceparent.decode() if isinstance(traceparent, bytes) else traceparent
        span = trace.get_current_span(propagate.extract({"traceparent": text}))
        context = span.get_span_context()
        if context.is_valid:
            links.setdefault((context.trace_id, context.span_id), trace.Link(context))
            if len(links) >= MAX_LINKS:
                break
    return list(links.values())
