"""The loader's batches as data: consumed messages gathered (`BatchBuffer`), then decoded into a
`Batch` (the newest event per group, the unreadable messages, the offsets it ends at). The insert
pipeline (inserts.py) stores batches; the cycle (loader.py) commits their offsets."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from confluent_kafka import Message

from pin_pipelines.devstats.events import (
    BadEvent,
    LayoutGroupUpserted,
    newest_per_group,
    parse_message,
)
from pin_pipelines.devstats.replay import RangedReplay
from pin_pipelines.tracing import tracing_enabled


@dataclass
class Batch:
    """A consumed batch, decoded; its insert may still be on its way (InsertPipeline)."""

    newest: dict[int, LayoutGroupUpserted]  # see newest_per_group
    bad: list[tuple[Message, str]]  # unreadable messages and why, for the DLQ
    ends: dict[int, int]  # partition → offset after the batch's last message
    size: int  # messages
    decoded: int  # readable events to guard, superseded ones included
    outside: int  # readable events of groups a ranged backfill leaves out (RangedReplay)
    started: float = field(default_factory=time.monotonic)
    fresh: list[LayoutGroupUpserted] = field(default_factory=list)  # newer than stored: inserted
    #: Group → Kafka timestamp (ms) of the message whose event `newest` kept.
    produced_ms: dict[int, int] = field(default_factory=dict)
    #: When its insert was confirmed (epoch ms): its events are visible from then.
    visible_ms: float = 0.0
    #: The recalcs that wrote these events (their `traceparent` headers), when tracing is on.
    origins: list[bytes] = field(default_factory=list)
    started_ns: int = field(default_factory=time.time_ns)

    @property
    def stale(self) -> int:
        """Readable events not inserted: older than stored, or superseded within the batch."""
        return self.decoded - len(self.fresh)

    def freshness(self) -> list[float]:
        """Produced → visible of each inserted event, seconds (once confirmed)."""
        return [
            round(max(0.0, self.visible_ms - self.produced_ms[event.id.int]) / 1000, 6)
            for event in self.fresh
        ]


def decode(messages: Sequence[Message], ends: dict[int, int], replay: RangedReplay | None) -> Batch:
    events: list[LayoutGroupUpserted] = []
    readable: list[Message] = []
    bad: list[tuple[Message, str]] = []
    outside = 0
    for msg in messages:
        try:
            event = parse_message(msg.key(), msg.value())
        except BadEvent as exc:
            bad.append((msg, str(exc)))
        else:
            if replay is not None and replay.skips(event.id, *position(msg)):
                outside += 1
            else:
                events.append(event)
                readable.append(msg)
    newest = newest_per_group(events)
    batch = Batch(newest, bad, ends, len(messages), len(events), outside)
    for event, msg in zip(events, readable, strict=True):
        key = event.id.int
        if newest[key] is event:
            batch.produced_ms[key] = msg.timestamp()[1]
    if tracing_enabled():
        batch.origins = [
            header[1]
            for msg in messages
            for header in msg.headers() or []
            if header[0] == "traceparent" and isinstance(header[1], bytes)
        ]
    return batch


class BatchBuffer:
    """Messages consumed and not decoded yet: a batch is ready when `size` are in hand or
    `seconds` passed since the first of them (or nothing more is coming)."""

    def __init__(self, size: int, seconds: float) -> None:
        self.size, self.seconds = size, seconds
        self.messages: list[Message] = []
        self.ends: dict[int, int] = {}  # partition → offset after its last message here
        self.started = 0.0

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def room(self) -> int:
        return self.size - len(self.messages)

    def add(self, msg: Message, partition: int, offset: int) -> None:
        if not self.messages:
            self.started = time.monotonic()
        self.messages.append(msg)
        self.ends[partition] = offset + 1

    def ready(self, *, more_coming: bool) -> bool:
        full = len(self.messages) >= self.size
        due = time.monotonic() - self.started >= self.seconds
        return bool(self.messages) and (full or due or not more_coming)

    def due_in(self) -> float:
        """Seconds until the batch in hand is due (0 when it is, or when nothing is in hand)."""
        if not self.messages:
            return 0.0
        return max(0.0, self.started + self.seconds - time.monotonic())

    def take(self, replay: RangedReplay | None) -> Batch:
        batch = decode(self.messages, self.ends, replay)
        self.clear()
        return batch

    def clear(self) -> None:
        self.messages, self.ends = [], {}


def position(msg: Message) -> tuple[int, int]:
    """Partition and offset (the stubs allow None, which only error events without one carry)."""
    partition, offset = msg.partition(), msg.offset()
    return (-1 if partition is None else partition), (-1 if offset is None else offset)
