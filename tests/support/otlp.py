"""A local OTLP/HTTP trace receiver for tests: a real HTTP server on loopback that decodes what
OpenTelemetry's own exporter sends (protobuf `ExportTraceServiceRequest` on POST /v1/traces)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pin_pipelines.stack.process import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id) in hex
    service_name: str


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.content_types: set[str] = set()
        self._lock = threading.Lock()
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request, self.headers.get("Content-Type", ""))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest, content_type: str) -> None:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in span.links],
                            service_name=service,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.content_types.add(content_type)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, name: str, count: int = 1, timeout: float = 15.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(found := self.named(name)) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{count} span(s) {name!r} not received: {self.spans}")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver._thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
        receiver._thread.join()
