"""The loader's state as data, without Kafka or ClickHouse: a partition's progress
(devstats/progress.py) and the batch in hand (devstats/batches.py), on real confluent-kafka
`Message` objects."""

from __future__ import annotations

import json
import time
import uuid

from confluent_kafka import Message

from pin_pipelines.devstats.batches import BatchBuffer, decode
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.devstats.progress import PartitionProgress
from pin_pipelines.devstats.replay import IdRange, RangedReplay
from tests.support.devstats import Group


def message(group: Group, version: int, partition: int = 0, offset: int = 0) -> Message:
    value = json.dumps(group.event(version)).encode()
    return Message(
        topic="t",
        partition=partition,
        offset=offset,
        key=str(group.id).encode(),
        value=value,
        timestamp=(1, 1_000 + offset),
    )


# --- PartitionProgress: a bounded cycle ---------------------------------------------------------


def test_a_bounded_cycle_reads_each_partition_up_to_its_start_watermark() -> None:
    """Tried: partition 0 with offsets 3..5 left (high 6), partition 1 empty (start = high):
    1 has nothing to read; 0 loads 3, 4, 5 and is finished at 5, past which nothing loads."""
    progress = PartitionProgress()
    assert progress.expect(0, 3, 6) and not progress.expect(1, 6, 6)
    assert progress.more_coming and progress.left() == 3
    assert progress.read(0, 3, at_end=False) == (True, False)
    assert progress.read(0, 4, at_end=False) == (True, False)
    assert progress.left() == 1
    assert progress.read(0, 5, at_end=False) == (True, True)
    assert progress.reached == {0: 6} and not progress.more_coming
    assert progress.read(0, 6, at_end=False) == (False, False)  # the next cycle's


def test_a_bounded_cycle_finishes_at_an_end_event_or_a_newer_message() -> None:
    """The end-of-partition event carries the end (transaction markers included: offset 8 for
    a last event at 5); a message past the watermark finishes the partition at its own offset."""
    progress = PartitionProgress()
    progress.expect(0, 3, 8)
    progress.expect(1, 0, 4)
    assert progress.read(0, 5, at_end=False) == (True, False)
    assert progress.read(0, 8, at_end=True) == (False, True)
    assert progress.read(1, 9, at_end=False) == (False, True)
    assert progress.reached == {0: 8, 1: 9} and progress.pending == {}


def test_a_continuous_load_reads_on_and_notes_where_each_end_was() -> None:
    progress = PartitionProgress(continuous=True)
    assert progress.expect(0, 6, 6) and progress.more_coming and progress.pending == {}
    assert progress.read(0, 100, at_end=False) == (True, False)
    assert progress.read(0, 104, at_end=True) == (False, False)
    assert progress.reached == {0: 104}


def test_offsets_become_committable_as_batches_are_stored_and_past_markers_at_the_end() -> None:
    """Tried: two stored batches, then the end reached past two transaction markers; an
    asynchronous commit sends each new state once; a revoke forgets all but what was sent."""
    progress = PartitionProgress(continuous=True)
    progress.stored({0: 4, 1: 2})
    assert progress.unsent() == {0: 4, 1: 2}
    assert progress.unsent() == {}  # an idle poll: nothing new
    progress.stored({0: 7})
    progress.read(0, 9, at_end=True)
    progress.read(1, 1, at_end=True)  # behind what is stored: never moves it back
    progress.skip_undelivered()
    assert progress.applied == {0: 9, 1: 2}
    assert progress.unsent() == {0: 9, 1: 2}
    progress.forget()
    assert (progress.applied, progress.reached, progress.pending) == ({}, {}, {})


# --- BatchBuffer and decode ---------------------------------------------------------------------


def test_a_batch_is_ready_when_full_due_or_nothing_more_is_coming() -> None:
    group = Group()
    buffer = BatchBuffer(size=2, seconds=0.05)
    assert not buffer.ready(more_coming=False)  # empty: never
    assert buffer.due_in() == 0.0  # nothing in hand: a wait for it has no end but its own
    buffer.add(message(group, 1, offset=0), 0, 0)
    assert not buffer.ready(more_coming=True)
    assert buffer.ready(more_coming=False)
    assert 0 < buffer.due_in() <= 0.05  # the loader's wait for more ends when it is due
    time.sleep(0.06)
    assert buffer.ready(more_coming=True) and buffer.due_in() == 0.0  # due
    buffer.add(message(group, 2, offset=1), 0, 1)
    assert buffer.room == 0 and buffer.ready(more_coming=True)  # full
    batch = buffer.take(None)
    assert len(buffer) == 0 and buffer.ends == {}
    assert (batch.size, batch.decoded, batch.ends) == (2, 2, {0: 2})
    assert [e.version for e in batch.newest.values()] == [2]  # superseded within the batch


def test_decode_sets_aside_unreadable_messages_and_a_ranged_replays_other_groups() -> None:
    """Tried: a readable event, one whose key is not its Id, one with an unparsable value, and
    a group outside a ranged backfill's range that the group had already passed."""
    inside, outside = Group(id=uuid.UUID(int=5)), Group(id=uuid.UUID(int=500))
    wrong_key = message(Group(), 1, offset=1)
    wrong_key.set_key(str(uuid.uuid4()).encode())
    garbage = message(Group(), 1, offset=2)
    garbage.set_value(b"{not json")
    replay = RangedReplay(IdRange(uuid.UUID(int=0), uuid.UUID(int=10)), {0: 10})
    messages = [message(inside, 3, offset=0), wrong_key, garbage, message(outside, 1, offset=3)]
    batch = decode(messages, {0: 4}, replay)
    assert [e.id for e in batch.newest.values()] == [inside.id]
    assert [m.offset() for m, _why in batch.bad] == [1, 2]
    assert (batch.size, batch.decoded, batch.outside) == (4, 1, 1)
    assert batch.produced_ms == {inside.id.int: 1_000}
    batch.fresh = list(batch.newest.values())
    batch.visible_ms = 3_500.0
    assert batch.freshness() == [2.5] and batch.stale == 0


def test_the_default_batch_is_at_most_1000_events_or_5_seconds() -> None:
    """Spec 003: the loader stores in batches of ≤ 1000 events / 5 s, and every path loads with
    LoadOptions' defaults for them (`pin devstats load`, `--once`, the Dagster asset set only
    max_seconds and should_stop). Tried: the defaults, and a buffer built from them as the
    loader builds it: full (ready, no room) at the 1000th event, and ready once 5 s have passed
    since its first event with more coming. Broken on purpose: batch_size 2000 or
    batch_seconds 10 as defaults each fail the first assertion."""
    options = LoadOptions()
    assert options.batch_size <= 1000 and options.batch_seconds <= 5.0
    group = Group()
    full = BatchBuffer(options.batch_size, options.batch_seconds)
    for offset in range(1000):
        full.add(message(group, 1, offset=offset), 0, offset)
    assert full.room <= 0 and full.ready(more_coming=True)
    slow = BatchBuffer(options.batch_size, options.batch_seconds)
    slow.add(message(group, 1), 0, 0)
    slow.started -= 5.0  # its first event arrived 5 s ago
    assert slow.ready(more_coming=True)
