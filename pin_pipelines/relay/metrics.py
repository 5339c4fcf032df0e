"""Relay metrics read from state, not from a relay process: an exporter, a Dagster observation or
an operator gets the same numbers whichever relay (or none) is running.

PostgreSQL holds the published/dead-lettered counters and the backlog; Kafka holds the offsets.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from pin_pipelines.db import fetch_all, fetch_one, queries
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import admin
from pin_pipelines.kafka_properties import failure
from pin_pipelines.sql_faces import OutboxQueries

Q = queries("outbox", OutboxQueries)


@dataclass(frozen=True)
class _TopicStats:
    """One topic's relay counters (topic_stats)."""

    topic: str
    published: int
    dead_lettered: int
    last_published_at: float | None


@dataclass(frozen=True)
class Backlog:
    """Events waiting in the outbox and the age of the oldest one, in seconds (0 when empty)."""

    pending: int
    lag_seconds: float


def backlog(conn: psycopg.Connection) -> Backlog:
    """The outbox's backlog now (the relay's summary, the exporter, the Dagster sensor)."""
    found = fetch_one(Q.backlog, conn, Backlog)
    assert found is not None  # an aggregate without GROUP BY: always one row
    return found


def topic_counters(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    """Per topic: events `published` and `dead_lettered` since the outbox existed, and
    `last_published_at` (epoch seconds or None)."""
    return {
        s.topic: {
            "published": s.published,
            "dead_lettered": s.dead_lettered,
            "last_published_at": s.last_published_at,
        }
        for s in fetch_all(Q.topic_stats, conn, _TopicStats)
    }


def relay_lag(conn: psycopg.Connection) -> dict[str, float | int]:
    """`pending` events and `lag_seconds`: age of the oldest one (0 when the outbox is empty)."""
    now = backlog(conn)
    return {"pending": now.pending, "lag_seconds": now.lag_seconds}


def events_beyond_source(conn: psycopg.Connection) -> int:
    """Events the relay's recovery found in Kafka whose rows this database never had (their
    transactions were lost), since the last repair cleared them."""
    return int(Q.events_beyond_source(conn))


def topic_end_offsets(
    bootstrap: str, topics: list[str], timeout: float = 10.0
) -> dict[str, dict[int, int]]:
    """Per topic and partition, the offset the next message will get (high watermark)."""
    client = admin(bootstrap)
    try:
        metadata = client.list_topics(timeout=timeout).topics
        wanted = {
            TopicPartition(topic, partition): OffsetSpec.latest()
            for topic in topics
            if topic in metadata
            for partition in metadata[topic].partitions
        }
        ends: dict[str, dict[int, int]] = {topic: {} for topic in topics}
        if wanted:
            for tp, future in client.list_offsets(wanted, request_timeout=timeout).items():
                ends[tp.topic][tp.partition] = future.result(timeout=timeout).offset
    except KafkaException as exc:
        raise PinError(
            failure(bootstrap, f"Kafka at {bootstrap} is unreachable: {exc.args[0]}", client)
        ) from exc
    except concurrent.futures.TimeoutError as exc:  # a result not in within the request timeout
        raise PinError(
            failure(bootstrap, f"Kafka at {bootstrap} did not answer within {timeout:g}s", client)
        ) from exc
    return ends
