"""The dim_layout_group loader: a bounded cycle (`load_once`) or a continuous load
(`load_continuously`) over the layout-group topic, one machinery for both (`_Cycle`).

Loaders are members of one consumer group (subscribe): N of them at once (on a ClickHouse server,
PIN_DEVSTATS_MAX_LOAD_RUNS, and a run and its successor during a hand-over) split the partitions.
A bounded cycle reads each partition it is assigned from the group's committed offset up to the
high watermark seen when it was assigned, so it always ends (new events wait for the next cycle).
A continuous load reads on (idle polls of 0.1 s) until its deadline or stop, then stores and
commits the batch in hand. When a rebalance takes its partitions (another loader joins or leaves),
the batch in hand is stored and its offsets committed before they are released: the next owner
starts where this one stopped, and nothing is skipped or applied twice.

Per batch (≤ 1000 events or 0.25 s since its first one): bad messages are set aside for the
DLQ, duplicates of a group reduced to the highest Version, the stored versions of the batch's
groups read in one query, the newer events inserted in one insert, the bad messages produced to
the DLQ, and only then the batch's offsets committed. A crash anywhere before
the commit replays the batch, and the version guard makes the replay a no-op for what was applied.
A message is unreadable when its value is not a contract event or its key is not the event's Id.
Reads are read_committed (the relay writes in Kafka transactions); a partition read to its end has
that end committed, past the transaction markers that no message stands for.

An insert is sent, and its answer awaited only when its connection is needed again: the server
stores one batch while this process decodes, guards and sends the next. On a server two inserts
are in flight, each on a connection of its own (`ClickHouse.inserts_in_flight`); the embedded
engine stores while it is sent. Batches are confirmed in the order they were sent, and only then
their DLQ messages go and their offsets become committable. A batch that has a group of a batch in
flight waits for it: a group's versions are stored in order (see _Cycle._next).
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from pin_pipelines.clickhouse import ClickHouse, ClickHouseUnavailable, open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.devstats.counters import record_loader_batch
from pin_pipelines.devstats.dim import insert_events, stored_versions
from pin_pipelines.devstats.dlq import DeadLetters
from pin_pipelines.devstats.events import (
    BadEvent,
    LayoutGroupUpserted,
    newest_per_group,
    parse_message,
)
from pin_pipelines.devstats.offsets import (
    DEFAULT_GROUP,
    RenewableConsumer,
    commit_offsets,
    committed_offsets,
    first_unloaded,
    kafka_consumer,
    no_longer_a_member,
    topic_partitions,
    watermarks,
)
from pin_pipelines.devstats.replay import EVERY_GROUP, IdRange, RangedReplay
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TOPIC_DEVSTATS_DLQ, TOPIC_LAYOUT_GROUP
from pin_pipelines.quantiles import quantile
from pin_pipelines.tracing import links_to, tracer, tracing_enabled

log = logging.getLogger("pin_pipelines.devstats")

CONSUME_TIMEOUT = 0.1  # seconds; see _Cycle._consume
#: Waiting for the group's assignment (join, or rejoin after a revocation or a lost session)
#: longer than this ends a bounded cycle with one line, not a silent wait until max_seconds
#: (coordinator unavailable); a continuous load joins again with a new consumer instead.
JOIN_TIMEOUT = 30.0


@dataclass(frozen=True)
class LoadOptions:
    topic: str = TOPIC_LAYOUT_GROUP
    group: str = DEFAULT_GROUP
    dlq_topic: str = TOPIC_DEVSTATS_DLQ
    batch_size: int = 1000
    #: A batch is stored at the latest this long after its first event arrived: with the 0.1 s
    #: idle poll, an event is visible within about half a second under a light flow.
    batch_seconds: float = 0.25
    #: Hard bound of one cycle, and the budget of a continuous load (`inf`: until stopped); what
    #: a cycle leaves shows as lag and `complete: false`.
    max_seconds: float = 300.0
    #: ClickHouse unreachable: attempts per batch, waiting 0.5 s, 1 s, 2 s, … between them.
    attempts: int = 5
    backoff_seconds: float = 0.5
    #: Checked between polls: the cycle stores and commits the batch in hand and ends early
    #: (`complete: false`), like at max_seconds (a clean stop of `pin serve`).
    should_stop: Callable[[], bool] = lambda: False


#: Samples kept for the freshness quantiles of a load (a uniform sample of its inserted events).
FRESHNESS_SAMPLES = 20_000
#: A continuous load records its inserted/skipped counters for the exporter this often.
COUNTERS_EVERY_SECONDS = 5.0


@dataclass
class LoadSummary:
    consumed: int = 0
    inserted: int = 0
    skipped_stale: int = 0  # older than the stored version, or superseded within the batch
    dead_lettered: int = 0
    skipped_out_of_range: int = 0  # a ranged backfill's events of other groups (RangedReplay)
    batches: int = 0
    lag: dict[int, int] = field(default_factory=dict)  # partition → events left after the load
    #: A cycle: False when max_seconds ran out before the start watermarks. A continuous load:
    #: whether it had caught up with the topic when it stopped (no lag left).
    complete: bool = True
    seconds: float = 0.0
    #: Produced (the message's Kafka timestamp) → visible (its insert confirmed) of the events
    #: this load inserted, seconds: p50, p99 and max (None when it inserted nothing).
    freshness_p50_seconds: float | None = None
    freshness_p99_seconds: float | None = None
    freshness_max_seconds: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "lag": {str(p): n for p, n in sorted(self.lag.items())}}


def load_once(settings: Settings, options: LoadOptions | None = None) -> LoadSummary:
    """One cycle: `pin devstats load --once`, the tests (a backfill is one after moving the
    group back)."""
    return _load(settings, options or LoadOptions(), continuous=False)


def load_continuously(settings: Settings, options: LoadOptions | None = None) -> LoadSummary:
    """Load as events come until `options.max_seconds` pass or `options.should_stop()`: `pin
    devstats load` without --once and the dim_layout_group asset's long-lived run.

    On the embedded engine this process owns the folder meanwhile and answers the other
    processes' statements (readers, its successor): see clickhouse/owner.py.
    """
    return _load(settings, options or LoadOptions(), continuous=True)


def _load(
    settings: Settings,
    options: LoadOptions,
    *,
    continuous: bool,
    replay: RangedReplay | None = None,
) -> LoadSummary:
    counters = _Counters(settings.pg_dsn, every=COUNTERS_EVERY_SECONDS if continuous else None)
    with (
        open_clickhouse(settings.clickhouse_url, serve=continuous) as ch,
        ExitStack() as more_connections,
        RenewableConsumer(settings.kafka_bootstrap, options.group) as consumers,
        _collector_paused(),
    ):
        writers = [ch] + [
            more_connections.enter_context(open_clickhouse(settings.clickhouse_url))
            for _ in range(ch.inserts_in_flight - 1)
        ]
        summary = _Cycle(
            writers, consumers, settings.kafka_bootstrap, options, continuous, counters, replay
        ).run()
    counters.record()
    return summary


class _Counters:
    """The exporter's inserted/skipped counters live in PostgreSQL: recorded after the offsets
    are committed, at the end of a load and every `every` seconds of a continuous one. Best
    effort: the load has succeeded, and a lost count must not turn it into a failure."""

    def __init__(self, pg_dsn: str, every: float | None) -> None:
        self.pg_dsn = pg_dsn
        self.every = every
        self.inserted = self.skipped_stale = 0
        self.recorded_at = time.monotonic()

    def add(self, inserted: int, skipped_stale: int) -> None:
        self.inserted += inserted
        self.skipped_stale += skipped_stale

    def record_if_due(self) -> None:
        if self.every is not None and time.monotonic() - self.recorded_at >= self.every:
            self.record()

    def record(self) -> None:
        self.recorded_at = time.monotonic()
        if not (self.inserted or self.skipped_stale):
            return
        try:
            with connection(self.pg_dsn, autocommit=True) as conn:
                record_loader_batch(conn, inserted=self.inserted, skipped_stale=self.skipped_stale)
        except (PinError, psycopg.Error) as exc:
            log.warning("loader counters not recorded: %s", exc)
        else:
            self.inserted = self.skipped_stale = 0


def backfill(
    settings: Settings, options: LoadOptions | None = None, ids: IdRange = EVERY_GROUP
) -> LoadSummary:
    """Replay the topic from the beginning through the loader's group (idempotent: the guard skips
    what is stored, so the dimension ends the same). Bad messages are dead-lettered again; the DLQ
    headers (source topic, partition, offset) identify repeats.

    With `ids` bounded, the events the group had passed that belong to other groups are read
    and not inserted (`skipped_out_of_range`); those it had not reached yet load as usual (see
    RangedReplay)."""
    options = options or LoadOptions()
    topic = options.topic
    with kafka_consumer(settings.kafka_bootstrap, options.group) as consumer:
        marks = {p: watermarks(consumer, topic, p) for p in topic_partitions(consumer, topic)}
        replay = None
        if marks:
            if ids.bounded:
                replay = RangedReplay(ids, _passed(consumer, topic, marks))
            commit_offsets(
                consumer, [TopicPartition(topic, p, low) for p, (low, _) in marks.items()]
            )
    return _load(settings, options, continuous=False, replay=replay)


def _passed(consumer: Consumer, topic: str, marks: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Partition → where the group's next load would start: what it had loaded ends there."""
    committed = committed_offsets(consumer, topic, list(marks))
    return {tp.partition: first_unloaded(tp.offset, *marks[tp.partition]) for tp in committed}


@dataclass
class _Batch:
    """A consumed batch, decoded; its insert may still be on its way (_Cycle.in_flight)."""

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
    #: The recalcs that wrote these events (their `traceparent` headers), when tracing is on.
    origins: list[bytes] = field(default_factory=list)
    started_ns: int = field(default_factory=time.time_ns)


def _decode(
    messages: Sequence[Message], ends: dict[int, int], replay: RangedReplay | None
) -> _Batch:
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
            if replay is not None and replay.skips(event.id, *_position(msg)):
                outside += 1
            else:
                events.append(event)
                readable.append(msg)
    newest = newest_per_group(events)
    batch = _Batch(newest, bad, ends, len(messages), len(events), outside)
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


class _Cycle:
    """One load: `continuous` reads every assigned partition on, past its watermark, until the
    deadline or a stop; otherwise each up to the watermark it had when assigned."""

    def __init__(
        self,
        writers: list[ClickHouse],
        consumers: RenewableConsumer,
        bootstrap: str,
        options: LoadOptions,
        continuous: bool,
        counters: _Counters,
        replay: RangedReplay | None,
    ) -> None:
        self.consumers = consumers
        self.bootstrap = bootstrap
        self.options = options
        self.continuous = continuous
        self.counters = counters
        self.replay = replay
        self.summary = LoadSummary()
        self.deadline = time.monotonic() + options.max_seconds
        #: Produced → visible of inserted events, seconds: a uniform sample of `freshness_seen`.
        self.freshness: list[float] = []
        self.freshness_seen = 0
        self.freshness_max: float | None = None
        self.dead_letters = DeadLetters(bootstrap, options.dlq_topic)
        self.applied: dict[int, int] = {}  # partition → next offset, once its batch is stored
        self.sent_commit: dict[int, int] = {}  # `applied` when last committed asynchronously
        #: Versions this cycle stored or read, by the group's UUID as an int (see
        #: newest_per_group): a group seen again skips the guard query, which costs about as much
        #: as the insert. A group's events are in one partition, and this loader is the only one
        #: that writes its partitions while they are assigned; forgotten when they are revoked.
        self.known_versions: dict[int, int] = {}
        #: Batches whose insert was sent and not confirmed yet, oldest first, each with the
        #: connection it went on; and the connections with no insert in flight.
        self.in_flight: deque[tuple[_Batch, ClickHouse]] = deque()
        self.free_writers: deque[ClickHouse] = deque(writers)
        #: Of the partitions assigned now: partition → high watermark when assigned, until read
        #: up to it; partition → next offset to read; partition → where it was finished.
        self.pending: dict[int, int] = {}
        self.nexts: dict[int, int] = {}
        self.reached: dict[int, int] = {}
        self.assigned = False  # the group gave this loader its share (maybe none)
        self.closing = False  # the cycle is over: the consumer's close revokes, nothing to do
        #: A synchronous commit failed after waiting COMMIT_TIMEOUT for the group's coordinator:
        #: the cycle is failing, and its end's commit would only wait as long again.
        self.commit_failed = False
        #: Consumed, not decoded yet; partition → offset after its last message there.
        self.buffer: list[Message] = []
        self.buffer_ends: dict[int, int] = {}

    @property
    def consumer(self) -> Consumer:
        return self.consumers.current

    def run(self) -> LoadSummary:
        started = time.monotonic()
        partitions = topic_partitions(self.consumer, self.options.topic)
        if partitions:
            self._subscribe()
            try:
                self._consume()
            finally:
                self.closing = True
        self.summary.lag = self._lag(partitions)
        if self.continuous:
            self.summary.complete = not any(self.summary.lag.values())
        self.summary.seconds = round(time.monotonic() - started, 3)
        ranked = sorted(self.freshness)
        self.summary.freshness_p50_seconds = quantile(ranked, 0.5)
        self.summary.freshness_p99_seconds = quantile(ranked, 0.99)
        self.summary.freshness_max_seconds = self.freshness_max
        return self.summary

    def _subscribe(self) -> None:
        self.consumer.subscribe(
            [self.options.topic],
            on_assign=self._assigned,
            on_revoke=self._revoked,
            on_lost=self._lost,
        )

    def _rejoin(self) -> None:
        """A continuous load out of its group for JOIN_TIMEOUT (its session lost across a
        partition, the coordinator moved): a new consumer joins in its place. What the old one
        stored is committed (a revoke) or replayed by its partitions' next owner (a loss), and
        the version guard skips it either way."""
        log.warning(
            "Kafka at %s: group %s assigned no partitions within %gs; joining it again with a "
            "new consumer",
            self.bootstrap,
            self.options.group,
            JOIN_TIMEOUT,
        )
        self.closing = True  # the old consumer's close has nothing of this load's to revoke
        try:
            self.consumers.renew()
        finally:
            self.closing = False
        self._subscribe()

    def _assigned(self, consumer: Consumer, assignment: list[TopicPartition]) -> None:
        """The group's share of this loader: each partition from the committed offset, until the
        high watermark of now (a cycle: those without work stay assigned, paused), or on. An
        assignment served by the close after the cycle takes nothing on: the consumer is being
        destroyed, and its committed() failed the load with `_DESTROY` (CI, a backfill run)."""
        if self.closing:
            return
        topic = self.options.topic
        parts = [tp.partition for tp in assignment]
        committed = {tp.partition: tp.offset for tp in committed_offsets(consumer, topic, parts)}
        positions, idle = [], []
        for p in parts:
            low, high = watermarks(consumer, topic, p)
            start = first_unloaded(committed.get(p, -1), low, high)
            if committed.get(p, -1) > high:
                log.warning(
                    "committed offset %s of %s[%s] is past its end %s: replaying from %s",
                    committed[p],
                    topic,
                    p,
                    high,
                    low,
                )
            positions.append(TopicPartition(topic, p, start))
            if self.continuous:
                continue
            if start < high:
                self.pending[p], self.nexts[p] = high, start
            else:
                idle.append(TopicPartition(topic, p))
        consumer.assign(positions)
        if idle:
            consumer.pause(idle)
        self.assigned = True

    def _revoked(self, consumer: Consumer, _revoking: list[TopicPartition]) -> None:
        """A rebalance takes the partitions (eager: all of them): store the batch in hand, commit
        what is stored, then let them go. The next owner resumes at the committed offsets. At the
        close after the cycle everything is committed already (or failed: nothing to add)."""
        if self.closing:
            return
        if self.buffer:
            self._flush()
        self._settle_in_flight()
        self._skip_undelivered(self.reached)
        self._commit_applied(asynchronous=False)
        self._forget_assignment()

    def _lost(self, _consumer: Consumer, _lost: list[TopicPartition]) -> None:
        """The session expired: the partitions are another loader's already, and a commit would
        be refused. What was not committed is replayed by the new owner (the guard skips it)."""
        while self.in_flight:
            _batch, writer = self.in_flight.popleft()
            with suppress(ClickHouseUnavailable):
                writer.confirm_insert()
            self.free_writers.append(writer)
        self._forget_assignment()

    def _forget_assignment(self) -> None:
        """Versions cached may be overtaken by the next owner of a partition: read them again."""
        self.buffer, self.buffer_ends = [], {}
        for state in (self.pending, self.nexts, self.reached, self.applied, self.known_versions):
            state.clear()
        self.assigned = False

    def _consume(self) -> None:
        """Poll until every assigned partition reached its watermark (a cycle), the deadline
        passed or `should_stop` (both modes).

        Asking `consume` for no more than is left makes it return as soon as that has arrived,
        instead of waiting out its timeout for a full batch. What is left can be overcounted
        (transaction markers take offsets and are never handed out), so the timeout is short: it
        bounds the wait at a partition's end, and a call that returns early only loops.
        """
        try:
            self._drain()
        finally:  # keep the progress of stored batches, also when a later batch fails
            self._commit_applied(asynchronous=False)
        self.summary.complete = self.assigned and not self.pending

    def _drain(self) -> None:
        pending, nexts = self.pending, self.nexts
        batch_started = 0.0
        unassigned_since = time.monotonic()
        while (
            (self.continuous or pending or not self.assigned)
            and time.monotonic() < self.deadline
            and not self.options.should_stop()
        ):
            if self.assigned:
                unassigned_since = time.monotonic()
            elif time.monotonic() - unassigned_since > JOIN_TIMEOUT:
                if self.continuous:
                    self._rejoin()
                    unassigned_since = time.monotonic()
                    continue
                raise PinError(
                    f"Kafka at {self.bootstrap}: group {self.options.group} assigned no "
                    f"partitions within {JOIN_TIMEOUT:g}s (coordinator unavailable?); stored "
                    "batches are committed, the next run resumes from there"
                )
            room = self.options.batch_size - len(self.buffer)
            left = room if self.continuous else sum(pending[p] - nexts[p] for p in pending)
            wanted = max(1, min(room, left))
            messages = self.consumer.consume(num_messages=wanted, timeout=CONSUME_TIMEOUT)
            for msg in messages:
                err = msg.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    raise PinError(f"Kafka at {self.bootstrap}: {err.str()}")
                p, offset = _position(msg)
                if self.continuous:
                    if err is None:
                        batch_started = batch_started if self.buffer else time.monotonic()
                        self.buffer.append(msg)
                        self.buffer_ends[p] = offset + 1
                    else:  # at the partition's end: committable once all before it is stored
                        self.reached[p] = offset
                    continue
                if p not in pending:
                    continue  # past its start watermark: left for the next cycle
                if err is None and offset < pending[p]:
                    batch_started = batch_started if self.buffer else time.monotonic()
                    self.buffer.append(msg)
                    nexts[p] = self.buffer_ends[p] = offset + 1
                if err is not None or offset + 1 >= pending[p]:
                    # An end-of-partition event carries the end; a newer message, its own offset.
                    end = offset if err is not None or offset >= pending[p] else offset + 1
                    self.reached[p] = end
                    del pending[p]
                    self.consumer.pause([TopicPartition(self.options.topic, p)])
            full = len(self.buffer) >= self.options.batch_size
            due = time.monotonic() - batch_started >= self.options.batch_seconds
            if self.buffer and (full or due or not (pending or self.continuous)):
                self._flush()
            elif not (messages or self.buffer) and self.continuous:
                self._caught_up()
        if self.buffer:
            self._flush()
        self._settle_in_flight()
        self._skip_undelivered(self.reached)

    def _caught_up(self) -> None:
        """Nothing arrived, nothing is waiting: confirm the batch in flight (it would otherwise
        wait for the next one) and commit up to where the partitions were read (past the
        transaction markers, see _skip_undelivered)."""
        self._settle_in_flight()
        self._skip_undelivered(self.reached)
        self.reached.clear()
        self._commit_applied(asynchronous=True)
        self.counters.record_if_due()

    def _flush(self) -> None:
        batch = _decode(self.buffer, self.buffer_ends, self.replay)
        self.buffer, self.buffer_ends = [], {}
        self._next(batch)

    def _skip_undelivered(self, reached: dict[int, int]) -> None:
        """Every batch is stored: a finished partition's offset moves to where it was finished.

        A read_committed consumer is never handed a transaction's commit or abort marker nor an
        aborted transaction's events, yet they take offsets; committing only past the last loaded
        event would leave them as lag that every cycle reads again (a marker ends every
        transaction of the relay).
        """
        for p, end in reached.items():
            if end > self.applied.get(p, -1):
                self.applied[p] = end

    def _commit_applied(self, *, asynchronous: bool) -> None:
        """Commit what is stored: asynchronously after each batch (a lost commit only replays
        applied events, which the guard skips), synchronously at the end, covering them all."""
        offsets = [TopicPartition(self.options.topic, p, o) for p, o in self.applied.items()]
        if asynchronous:
            if offsets and self.applied != self.sent_commit:  # an idle poll has nothing new
                self.consumer.commit(offsets=offsets, asynchronous=True)
                self.sent_commit = dict(self.applied)
        elif offsets and not self.commit_failed:
            try:
                commit_offsets(self.consumer, offsets)
            except (KafkaException, PinError) as exc:
                if not no_longer_a_member(exc):
                    self.commit_failed = True
                    raise
                # Like _lost: the stored batches are replayed by the partitions' next owner (this
                # loader after it rejoins, or another), and the version guard skips them.
                log.warning(
                    "offsets not committed, the group moved on without this loader: %s",
                    exc.args[0].str(),
                )

    def _next(self, batch: _Batch) -> None:
        """Send this batch's insert on a connection with none in flight, confirming the oldest
        batches in flight first while there is no such connection or while one of them has a
        group of this batch.

        The second wait keeps a group's versions stored in the order they were consumed, as with
        one connection: among rows of equal UpsertedAt (whole seconds on 18.16) ReplacingMergeTree
        keeps the last inserted, which must be the newest version (dim_layout_group.sql). It also
        lets the guard ignore the batches in flight: they hold none of this batch's groups."""
        while self.in_flight and (not self.free_writers or self._shares_a_group(batch)):
            self._settle_oldest()
        writer = self.free_writers.popleft()
        try:
            self._write(batch, writer)
        except ClickHouseUnavailable as exc:
            self._settle_in_flight()  # the batches sent before this one finish first
            self._retrying(batch, writer, exc)
            self._finish(batch)
            self.free_writers.append(writer)
        else:
            self.in_flight.append((batch, writer))

    def _shares_a_group(self, batch: _Batch) -> bool:
        return any(not batch.newest.keys().isdisjoint(sent.newest) for sent, _ in self.in_flight)

    def _settle_in_flight(self) -> None:
        while self.in_flight:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        batch, writer = self.in_flight.popleft()
        try:
            writer.confirm_insert()
        except ClickHouseUnavailable as exc:
            self._retrying(batch, writer, exc)
        else:
            self._remember(batch)
        self.free_writers.append(writer)
        self._finish(batch)

    def _write(self, batch: _Batch, writer: ClickHouse) -> None:
        """Guard and send the insert (the first attempt). The stored versions are read again on
        every attempt: an insert that landed before its answer was lost is then skipped, not
        stored twice."""
        known = self.known_versions
        unseen = [e.id for key, e in batch.newest.items() if key not in known]
        if unseen:
            known.update(stored_versions(writer, unseen))
        batch.fresh = [e for key, e in batch.newest.items() if e.version > known.get(key, -1)]
        if batch.fresh:
            insert_events(writer, batch.fresh)

    def _remember(self, batch: _Batch) -> None:
        """The batch is stored: its versions are known, and its events visible from now."""
        self.known_versions.update((e.id.int, e.version) for e in batch.fresh)
        visible_ms = time.time() * 1000
        for event in batch.fresh:
            lag = round(max(0.0, visible_ms - batch.produced_ms[event.id.int]) / 1000, 6)
            self.freshness_max = max(lag, self.freshness_max or 0.0)
            self.freshness_seen += 1
            if len(self.freshness) < FRESHNESS_SAMPLES:
                self.freshness.append(lag)
            else:  # a uniform sample of all of them (reservoir)
                slot = random.randrange(self.freshness_seen)
                if slot < FRESHNESS_SAMPLES:
                    self.freshness[slot] = lag

    def _finish(self, batch: _Batch) -> None:
        """The batch is stored: its unreadable messages go to the DLQ, then its offsets become
        committable."""
        self.dead_letters.send(batch.bad)
        self.applied.update(batch.ends)
        self._commit_applied(asynchronous=True)
        self.summary.batches += 1
        self.summary.consumed += batch.size
        self.summary.inserted += len(batch.fresh)
        self.summary.skipped_stale += batch.decoded - len(batch.fresh)
        self.summary.dead_lettered += len(batch.bad)
        self.summary.skipped_out_of_range += batch.outside
        self.counters.add(len(batch.fresh), batch.decoded - len(batch.fresh))
        self.counters.record_if_due()
        if tracing_enabled():  # from its decoding to its offsets, linked to its recalcs
            span = tracer().start_span(
                "devstats.load_batch",
                start_time=batch.started_ns,
                links=links_to(batch.origins),
                attributes={
                    "topic": self.options.topic,
                    "messages": batch.size,
                    "inserted": len(batch.fresh),
                    "dead_lettered": len(batch.bad),
                },
            )
            span.end()

    def _retrying(self, batch: _Batch, writer: ClickHouse, failed: ClickHouseUnavailable) -> None:
        """Attempts 2, 3, … of a batch whose first attempt (guard, sent insert) failed, waiting
        0.5 s, 1 s, 2 s, … before each; each waits for the server's answer (a silent server is
        found by keepalive within DEAD_PEER_SECONDS: clickhouse/server.py)."""
        attempts = 1
        while attempts < self.options.attempts:
            # The failed insert may have landed or not: the guard must read, not trust memory.
            for key in batch.newest:
                self.known_versions.pop(key, None)
            wait = self.options.backoff_seconds * 2 ** (attempts - 1)
            log.warning(
                "ClickHouse insert failed (attempt %d: %s); trying again in %gs",
                attempts,
                failed,
                wait,
            )
            time.sleep(wait)
            attempts += 1
            try:
                self._write(batch, writer)
                writer.confirm_insert()
            except ClickHouseUnavailable as exc:
                failed = exc
            else:
                self._remember(batch)
                return
        raise ClickHouseUnavailable(
            f"{failed} (gave up after {attempts} attempts in "
            f"{time.monotonic() - batch.started:.1f}s; this batch's offsets are not "
            "committed, the next run replays it)"
        ) from failed

    def _lag(self, partitions: Sequence[int]) -> dict[int, int]:
        if not partitions:
            return {}
        topic = self.options.topic
        committed = committed_offsets(self.consumer, topic, partitions)
        lag = {}
        for tp in committed:
            low, high = watermarks(self.consumer, topic, tp.partition)
            lag[tp.partition] = high - first_unloaded(tp.offset, low, high)
        return lag


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off during a cycle (measured: a quarter of the loader's CPU).

    A batch's events live for milliseconds, yet long enough to be promoted, so the collector kept
    rescanning the whole process heap every few thousand events. The cycle's objects are freed by
    reference counting anyway; the rare cyclic garbage it makes waits until the cycle ends.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _position(msg: Message) -> tuple[int, int]:
    """Partition and offset (the stubs allow None, which only error events without one carry)."""
    partition, offset = msg.partition(), msg.offset()
    return (-1 if partition is None else partition), (-1 if offset is None else offset)
