"""Metrics read from PostgreSQL at scrape time: the recalc queue (gauges), the counters the work
persists (`recalc.counters`, `devstats.counters`), worker liveness and the outbox relay's backlog
and counters.

`read_state` does the I/O; `families` turns a state into metric families and, given None, the
same families without samples, which is what the exporter's `describe()` serves. One function
therefore defines every name, so the list the CI checks dashboards against cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import psycopg
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from pin_pipelines.db import fetch_all, fetch_column, fetch_one, queries
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT
from pin_pipelines.recalc import ENTITIES, RESULT_LABELS
from pin_pipelines.relay import events_beyond_source, relay_lag, topic_counters
from pin_pipelines.sql_faces import MetricsQueries

Q = queries("metrics", MetricsQueries)

#: Outbox topics served with 0 before their first event, so rate() has a baseline.
OUTBOX_TOPICS = (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP)


@dataclass(frozen=True)
class _QueueGauges:
    """The queue at scrape time (queue_gauges)."""

    depth: int
    due_backlog: int
    due_backlog_unpoisoned: int
    poisoned: int
    oldest_due_age_seconds: float


@dataclass(frozen=True)
class _WorkerTicks:
    """Drain ticks of every session and the newest one's unix time, None before the first."""

    ticks: int
    last_tick_at: float | None


@dataclass(frozen=True)
class _SchedulerBeats:
    """Beats of every scheduler and the newest one's unix time, None before the first."""

    beats: int
    last_beat_at: float | None


@dataclass(frozen=True)
class _CounterTotal:
    """One persisted counter, shards summed (counter_totals)."""

    metric: str
    label: str
    value: float


@dataclass(frozen=True)
class PostgresState:
    depth: int = 0
    due_backlog: int = 0
    due_backlog_unpoisoned: int = 0
    poisoned: int = 0
    oldest_due_age_seconds: float = 0.0
    #: (metric, label) → value, shards summed (`metric_counters` rows).
    counters: dict[tuple[str, str], float] = field(default_factory=dict)
    bucket_bounds: tuple[float, ...] = ()
    ticks: int = 0
    last_tick_at: float = 0.0  # unix time; 0 before the first tick
    beats: int = 0
    last_beat_at: float = 0.0  # unix time; 0 before the first beat
    outbox_pending: int = 0
    outbox_lag_seconds: float = 0.0
    #: topic → (published, dead_lettered)
    outbox_topics: dict[str, tuple[float, float]] = field(default_factory=dict)
    events_beyond_source: int = 0


def read_state(conn: psycopg.Connection) -> PostgresState:
    """Everything in one short read-only pass (autocommit: no snapshot is held open)."""
    queue = fetch_one(Q.queue_gauges, conn, _QueueGauges)
    ticks = fetch_one(Q.worker_ticks, conn, _WorkerTicks)
    beats = fetch_one(Q.scheduler_beats, conn, _SchedulerBeats)
    # aggregates without GROUP BY: one row each
    assert queue is not None and ticks is not None and beats is not None
    lag = relay_lag(conn)
    return PostgresState(
        depth=queue.depth,
        due_backlog=queue.due_backlog,
        due_backlog_unpoisoned=queue.due_backlog_unpoisoned,
        poisoned=queue.poisoned,
        oldest_due_age_seconds=queue.oldest_due_age_seconds,
        counters={
            (c.metric, c.label): c.value for c in fetch_all(Q.counter_totals, conn, _CounterTotal)
        },
        bucket_bounds=tuple(fetch_column(Q.duration_buckets, conn)),
        ticks=ticks.ticks,
        last_tick_at=ticks.last_tick_at or 0.0,
        beats=beats.beats,
        last_beat_at=beats.last_beat_at or 0.0,
        outbox_pending=int(lag["pending"]),
        outbox_lag_seconds=float(lag["lag_seconds"]),
        outbox_topics={
            topic: (float(c["published"]), float(c["dead_lettered"]))
            for topic, c in topic_counters(conn).items()
        },
        events_beyond_source=events_beyond_source(conn),
    )


def families(state: PostgresState | None) -> list[Metric]:
    """The metric families of `state`; without a state, the same families without samples."""
    return [
        *_gauges(state),
        *_recalc_counters(state),
        *_ticks(state),
        *_outbox(state),
        *_loader_counters(state),
    ]


#: (name, help, PostgresState attribute) of every gauge this source serves.
GAUGES = (
    (
        "chessboard_recalc_queue_depth",
        "Rows in chessboard.project_recalc_requests (due, debouncing and poisoned).",
        "depth",
    ),
    (
        "chessboard_recalc_due_backlog",
        "Queue rows with due_at < now() (spec 000), poisoned rows included.",
        "due_backlog",
    ),
    (
        "chessboard_recalc_due_backlog_unpoisoned",
        "Queue rows with due_at < now() waiting for a drain, poisoned rows left out (they have"
        " their own alert): what CHESSBOARD_RECALC_BACKLOG watches.",
        "due_backlog_unpoisoned",
    ),
    (
        "chessboard_recalc_poisoned_requests",
        "Queue rows parked after poison_attempts failures (runbook: fix, then requeue).",
        "poisoned",
    ),
    (
        "chessboard_recalc_oldest_due_age_seconds",
        "How long the oldest due, non-poisoned row has been due (0 when none is).",
        "oldest_due_age_seconds",
    ),
    (
        "chessboard_recalc_last_tick_timestamp_seconds",
        "Unix time of the newest drain tick (0 before the first one): worker liveness.",
        "last_tick_at",
    ),
    (
        "chessboard_recalc_scheduler_last_beat_timestamp_seconds",
        "Unix time of the recalc scheduler's newest beat (0 before the first one): it beats on"
        " every evaluation, rows due or not, so a dead scheduler shows on an empty queue too.",
        "last_beat_at",
    ),
    (
        "chessboard_outbox_pending_events",
        "Events in chessboard.outbox_events not yet acknowledged by Kafka.",
        "outbox_pending",
    ),
    (
        "chessboard_outbox_lag_seconds",
        "Age of the oldest unpublished outbox event (0 when the outbox is empty).",
        "outbox_lag_seconds",
    ),
    (
        "chessboard_outbox_events_beyond_source",
        "Events Kafka holds whose PostgreSQL transactions were lost (a failover to a lagging"
        " standby, a restore from a backup), found by the relay's recovery, since the last"
        " `pin reconcile --repair`: Versions the source will issue again with other content.",
        "events_beyond_source",
    ),
)


def _gauges(s: PostgresState | None) -> Iterable[Metric]:
    for name, doc, attr in GAUGES:
        family = GaugeMetricFamily(name, doc)
        if s is not None:
            family.add_metric([], float(getattr(s, attr)))
        yield family


def _recalc_counters(s: PostgresState | None) -> Iterable[Metric]:
    counters = s.counters if s else {}
    runs = CounterMetricFamily(
        "chessboard_recalc_runs", "Claimed projects by result.", labels=["result"]
    )
    republished = CounterMetricFamily(
        "chessboard_recalc_republished",
        "Snapshot events written to the outbox by the recalc, by entity.",
        labels=["entity"],
    )
    coalesced = CounterMetricFamily(
        "chessboard_recalc_coalesced_events",
        "Recalc requests coalesced into completed runs (sum of requested_count).",
    )
    if s is not None:
        for result in RESULT_LABELS.values():
            runs.add_metric([result], counters.get(("runs", result), 0.0))
        for entity in ENTITIES:
            republished.add_metric([entity], counters.get(("republished", entity), 0.0))
        coalesced.add_metric([], counters.get(("coalesced_events", ""), 0.0))
    yield from (runs, republished, coalesced)
    yield _duration_histogram(s)


def _duration_histogram(s: PostgresState | None) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "chessboard_recalc_process_duration_seconds",
        "Time to process one claimed project (deferred ones excluded). SLO: p99 < 2 s.",
    )
    if s is None:
        return family
    per_bucket = {
        float(label): value
        for (metric, label), value in s.counters.items()
        if metric == "duration_bucket"
    }
    buckets, cumulative = [], 0.0
    for le in (*s.bucket_bounds, math.inf):
        cumulative += per_bucket.get(le, 0.0)
        buckets.append((floatToGoString(le), cumulative))
    family.add_metric([], buckets, s.counters.get(("duration_sum", ""), 0.0))
    return family


def _ticks(s: PostgresState | None) -> Iterable[Metric]:
    ticks = CounterMetricFamily(
        "chessboard_recalc_ticks", "Drain ticks, including ticks that found nothing due."
    )
    if s is not None:
        ticks.add_metric([], s.ticks)
    beats = CounterMetricFamily(
        "chessboard_recalc_scheduler_beats",
        "Evaluations of the recalc scheduler (the Dagster sensor), rows due or not.",
    )
    if s is not None:
        beats.add_metric([], s.beats)
    yield from (ticks, beats)


def _outbox(s: PostgresState | None) -> Iterable[Metric]:
    published = CounterMetricFamily(
        "chessboard_outbox_published", "Events the relay published, by topic.", labels=["topic"]
    )
    dead = CounterMetricFamily(
        "chessboard_outbox_dead_lettered",
        "Outbox events moved to chessboard.outbox_dead_letters, by topic.",
        labels=["topic"],
    )
    if s is not None:
        topics = {topic: (0.0, 0.0) for topic in OUTBOX_TOPICS} | s.outbox_topics
        for topic, (sent, dropped) in sorted(topics.items()):
            published.add_metric([topic], sent)
            dead.add_metric([topic], dropped)
    yield from (published, dead)


def _loader_counters(s: PostgresState | None) -> Iterable[Metric]:
    """The loader's ClickHouse outcome; consumed, dead-lettered and lag come from Kafka."""
    inserted = CounterMetricFamily(
        "devstats_loader_inserted",
        "Rows the dimension loader inserted into dim_layout_group (recorded by the loader).",
    )
    stale = CounterMetricFamily(
        "devstats_loader_skipped_stale",
        "Events the loader skipped by its version guard (recorded by the loader).",
    )
    if s is not None:
        inserted.add_metric([], s.counters.get(("loader_inserted", ""), 0.0))
        stale.add_metric([], s.counters.get(("loader_skipped_stale", ""), 0.0))
    yield from (inserted, stale)
