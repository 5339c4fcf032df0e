"""The event log of a run is O(1) rows, whatever the run processed: per-project and
per-message lines go to the run's stdout (compute logs) as JSON lines, not to the event log.

The drain is measured over N projects; the relay and the loader are long-lived
(a run of each lasts 5 minutes and stores a batch every fraction of a second), so they are
measured over one batch and over many: a line or an event per batch would be per-run growth of
the same kind."""

from __future__ import annotations

import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dagster as dg
import psycopg

from pin_pipelines.definitions import defs
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.kafka import TOPIC_PROJECT
from tests.support.chessboard import make_building, make_layout, make_object, make_project
from tests.support.devstats import Group, produce_events
from tests.support.devstats_dagster import load_config, metadata_of
from tests.support.outbox import insert, payload
from tests.support.relay import relay_config

#: A long-lived run's budget in these tests: the loader joins its group within it and then
#: stores a batch per event that arrives EVERY seconds apart (a batch closes 0.25 s after its
#: first event).
BUDGET = 8.0
EVERY = 0.4
MANY_BATCHES = 5


def _due_projects(conn: psycopg.Connection, count: int) -> None:
    for _ in range(count):
        project = make_project(conn)
        building = make_building(conn, project)
        make_object(conn, project, building, make_layout(conn, project, None, 30), status="Free")
    conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")


def _event_rows(instance: dg.DagsterInstance, run_id: str) -> Counter[str]:
    return Counter(
        e.dagster_event.event_type_value if e.dagster_event else "log_message"
        for e in instance.all_logs(run_id)
    )


@contextmanager
def _every(seconds: float, action: Callable[[], None]) -> Iterator[None]:
    """`action` every `seconds` on a thread while the block runs (a run in process blocks this
    one), stopped and joined on exit."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(seconds):
            action()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_drain_run_writes_as_many_event_rows_for_30_projects_as_for_3(db, pg_instance, capfd):
    """Tried: recalc_drain_job on a PostgreSQL-backed instance over 3, then 30 due projects.
    Before the per-project lines moved to stdout, each project added its `project_recalculated` line
    to the event log (161 rows for a drain run in production); now both runs write the same number
    of rows: the run's events, one summary line and the asset event; the per-project JSON lines are
    on the run's stdout (what Dagster captures as its compute logs)."""
    job = defs.get_job_def("recalc_drain_job")
    rows = []
    for projects in (3, 30):
        _due_projects(db, projects)
        result = job.execute_in_process(instance=pg_instance, resources=RESOURCES)
        assert result.success
        rows.append(_event_rows(pg_instance, result.run_id))
        stdout = capfd.readouterr().out
        assert stdout.count('"event": "project_recalculated"') == projects
    assert rows[0] == rows[1], rows
    assert sum(rows[1].values()) <= 20, rows[1]


def test_a_load_run_writes_as_many_event_rows_for_many_batches_as_for_one(
    private_topic: LoadOptions,
    kafka_bootstrap: str,
    pg_instance: dg.DagsterInstance,
) -> None:
    """Tried: dim_layout_group_job (the continuous loader, budget 8 s) on a PostgreSQL-backed
    instance, on a topic and group of this test: once with one event waiting (one batch), once
    with an event produced every 0.4 s while it loads (a batch each). Both runs write the same
    event rows (17 in process: the run's and steps' events, the one materialization with the
    run's summary, the freshness check), at most the goal's 20; nothing is written per batch."""
    job = defs.resolve_job_def(dim_layout_group_job.name)

    def produce_one() -> None:
        produce_events(kafka_bootstrap, private_topic.topic, [Group().event(1)])

    def load() -> tuple[int, Counter[str]]:
        result = job.execute_in_process(run_config=load_config(BUDGET), instance=pg_instance)
        assert result.success
        [materialization] = result.asset_materializations_for_node("dim_layout_group")
        return metadata_of(materialization)["batches"], _event_rows(pg_instance, result.run_id)

    produce_one()
    one = load()
    with _every(EVERY, produce_one):
        many = load()
    assert one[0] == 1 and many[0] >= MANY_BATCHES, (one, many)
    assert one[1] == many[1], (one, many)
    assert sum(many[1].values()) <= 20, many[1]


def test_a_relay_run_writes_as_many_event_rows_for_many_batches_as_for_one(
    outbox: psycopg.Connection, pg_dsn: str, pg_instance: dg.DagsterInstance
) -> None:
    """Tried: outbox_relay_job (the continuous relay, budget 8 s) on a PostgreSQL-backed
    instance: once with one outbox event waiting (one Kafka transaction), once with an event
    committed every 0.4 s while it relays (a transaction each). Both runs write the same event
    rows: the run's events, the `relay summary` line with the batch count and the topic's
    materialization; the per-batch lines are DEBUG lines on stdout."""

    def relay() -> tuple[int, Counter[str]]:
        result = outbox_relay_job.execute_in_process(
            run_config=relay_config(BUDGET), resources=RESOURCES, instance=pg_instance
        )
        assert result.success
        [summary] = [
            e.message
            for e in pg_instance.all_logs(result.run_id)
            if e.message.startswith("relay summary: ")
        ]
        batches = re.search(r"'batches': (\d+)", summary)
        assert batches, summary
        return int(batches[1]), _event_rows(pg_instance, result.run_id)

    def outbox_event(conn: psycopg.Connection) -> None:
        key = str(uuid.uuid4())
        insert(conn, [(TOPIC_PROJECT, key, payload(TOPIC_PROJECT, key, 1))])

    outbox_event(outbox)
    one = relay()
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        _every(EVERY, lambda: outbox_event(conn)),
    ):
        many = relay()
    assert one[0] == 1 and many[0] >= MANY_BATCHES, (one, many)
    assert one[1] == many[1], (one, many)
    assert sum(many[1].values()) <= 20, many[1]
