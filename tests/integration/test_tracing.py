"""Trace spans (spec 000 "Traces"), exported by OpenTelemetry's own OTLP/HTTP exporter
from real `pin` processes to a real local HTTP receiver, configured by the standard variables."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg

from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.otlp import otlp_receiver
from tests.support.recalc import PIN, REPO_ROOT, last_json_line, queue_row


def _run(dsn: str, argv: list[str], **env: str) -> str:
    """A process of its own (a tracer is set up once per process), OTEL_* only as given."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env={**clean, "PIN_PG_DSN": dsn, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _pin(dsn: str, *args: str, **env: str) -> dict:
    return last_json_line(_run(dsn, [PIN, *args], **env))


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
    assert tick.attributes["correlationId"] == summary["correlation_id"]
    assert (span.trace_id, span.parent_span_id) == (tick.trace_id, tick.span_id)
    assert span.service_name == "pin-test"
    assert span.attributes["ProjectId"] == str(project)
    assert span.attributes["TenantId"] == str(tenant)
    assert span.attributes["LastReason"] == reason
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


def test_the_loader_span_links_back_to_the_recalc_that_wrote_the_event(
    db, pg_dsn, tmp_path, loader_options
):
    """Tried: a new layout group is drained, relayed and loaded by three processes, each
    exporting to the same local receiver (the group's events go to this test's private topic,
    registered with the relay, and a private consumer group loads them). The relay's
    `relay.batch` span is exported, the message carries the project span's `traceparent`
    header, and the loader's `devstats.load_batch` span links to that project span: a trace
    leads from a dimension row back to the recalc that caused it."""
    project = make_project(db)
    make_layout_group(db, project, "Студии")
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    db.execute(
        "INSERT INTO chessboard.outbox_topics (topic, required_fields)"
        " SELECT %s, required_fields FROM chessboard.outbox_topics WHERE topic = %s",
        (loader_options.topic, TOPIC_LAYOUT_GROUP),
    )
    load = (
        "from pin_pipelines.config import Settings\n"
        "from pin_pipelines.devstats.loader import LoadOptions, load_once\n"
        f"s = load_once(Settings.from_env(), LoadOptions(topic={loader_options.topic!r},"
        f" group={loader_options.group!r}, dlq_topic={loader_options.dlq_topic!r}))\n"
        "print(s.inserted)\n"
    )
    with otlp_receiver() as otlp:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",  # this test's own dimension
        }
        _pin(pg_dsn, "db", "migrate", **env)
        assert _pin(pg_dsn, "recalc", "drain", "--once", **env)["processed"] == 1
        db.execute(
            "UPDATE chessboard.outbox_events SET topic = %s WHERE topic = %s",
            (loader_options.topic, TOPIC_LAYOUT_GROUP),
        )
        assert _pin(pg_dsn, "outbox", "relay", "--once", **env)["published"] >= 2
        assert _run(pg_dsn, [sys.executable, "-c", load], **env).strip() == "1"
        (project_span,) = otlp.wait_for("recalc.project")
        otlp.wait_for("relay.batch")
        load_spans = otlp.wait_for("devstats.load_batch")
    origin = (project_span.trace_id, project_span.span_id)
    assert any(origin in span.links for span in load_spans), load_spans
