"""Transactional outbox relay: PostgreSQL `chessboard.outbox_events` → Kafka, exactly
once through Kafka transactions and their receipts.

Core is plain Python + SQL (sql/postgres/queries/outbox.sql); Dagster and the CLI only call in.
"""

from pin_pipelines.relay.metrics import (
    events_beyond_source,
    relay_lag,
    topic_counters,
    topic_end_offsets,
)
from pin_pipelines.relay.outbox import OutboxRelay, relay_once
from pin_pipelines.relay.summary import RelaySummary

__all__ = [
    "OutboxRelay",
    "RelaySummary",
    "events_beyond_source",
    "relay_lag",
    "relay_once",
    "topic_counters",
    "topic_end_offsets",
]
