"""Trace spans (spec 000 "Traces", issue 13), exported by OpenTelemetry's own OTLP/HTTP exporter
from real `pin` processes to a real local HTTP receiver, configured by the standard variables."""

from __future__ import annotations

import os
import subprocess

import psycopg

from tests.support.chessboard import make_building, make_layout, make_object, make_project
from tests.support.otlp import otlp_receiver
from tests.support.recalc import PIN, REPO_ROOT, last_json_line, queue_row


def _pin(dsn: str, *args: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [PIN, *args],
        cwd=REPO_ROOT,
        env={**clean, "PIN_PG_DSN": dsn, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return last_json_line(result.stdout)


def _due_project(conn: psycopg.Connection):
    project = make_project(conn)
    building = make_building(conn, project)
    layout = make_layout(conn, project, None, 33)
    make_object(conn, project, building, layout, status="Free", price=10)
    conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    return project


def test_drain_spans_reach_an_otlp_http_endpoint_with_the_spec_attributes(db, pg_dsn):
    """Tried: `pin recalc drain --once` with only OTEL_EXPORTER_OTLP_ENDPOINT (and the protocol
    named http/protobuf) pointing at a local receiver. It gets one `recalc.tick` span carrying
    the tick's correlation id and, inside it, a `recalc.project` span with the spec's ProjectId,
    TenantId and LastReason; the project's outbox events carry that span's traceparent."""
    project = _due_project(db)
    tenant, reason = (
        db.execute(
            "SELECT r.tenant_id, r.last_reason FROM chessboard.project_recalc_requests r"
            " WHERE r.project_id = %s",
            (project,),
        ).fetchone()
        or ()
    )
    with otlp_receiver() as otlp:
        summary = _pin(
            pg_dsn,
            "recalc",
            "drain",
            "--once",
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_SERVICE_NAME="pin-test",
        )
        (tick,) = otlp.wait_for("recalc.tick")
        (span,) = otlp.wait_for("recalc.project")
    assert summary["processed"] == 1
    assert otlp.content_types == {"application/x-protobuf"}
    assert tick.attributes["correlation_id"] == summary["correlation_id"]
    assert (span.trace_id, span.parent_span_id) == (tick.trace_id, tick.span_id)
    assert span.service_name == "pin-test"
    assert span.attributes["project_id"] == str(project)
    assert span.attributes["tenant_id"] == str(tenant)
    assert span.attributes["last_reason"] == reason
    traceparents = {
        tp.rsplit("-", 1)[0]  # the flags (sampled, random trace id) are the SDK's to set
        for (tp,) in db.execute("SELECT traceparent FROM chessboard.outbox_events").fetchall()
    }
    assert traceparents == {f"00-{span.trace_id}-{span.span_id}"}


def test_nothing_is_traced_or_exported_without_the_otel_variables(db, pg_dsn):
    """Tried: the same drain with no OTEL_* variable at all: it works as before, and its events
    carry no traceparent (the no-op tracer: nothing leaves the process)."""
    project = _due_project(db)
    assert _pin(pg_dsn, "recalc", "drain", "--once")["processed"] == 1
    assert queue_row(db, project) is None
    traceparents = db.execute("SELECT DISTINCT traceparent FROM chessboard.outbox_events")
    assert traceparents.fetchall() == [(None,)]
