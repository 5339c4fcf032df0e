"""The dim_layout_group loader: a bounded cycle (`load_once`) or a continuous load
(`load_continuously`) over the layout-group topic, one machinery for both (`_Cycle`).

Loaders are members of one consumer group (subscribe): N of them at once (on a ClickHouse server,
PIN_DEVSTATS_MAX_LOAD_RUNS, and a run and its successor during a hand-over) split the partitions.
A bounded cycle reads each partition it is assigned from the group's committed offset up to the
high watermark seen when it was assigned, so it always ends (new events wait for the next cycle).
A continuous load reads on (waiting for the first message of a batch up to IDLE_WAIT_SECONDS,
handed over as it arrives) until its deadline or stop, then stores and commits the batch in
hand. When a rebalance takes its partitions (another loader joins or leaves), the batch in hand
is stored and its offsets committed before they are released: the next owner starts where this
one stopped, and nothing is skipped or applied twice.

Per batch (≤ 1000 events or 0.25 s since its first one): bad messages are set aside for the
DLQ, duplicates of a group reduced to the highest Version, the stored versions of the batch's
groups read in one query, the newer events inserted in one insert, the bad messages produced to
the DLQ, and only then the batch's offsets committed. A crash anywhere before
the commit replays the batch, and the version guard makes the replay a no-op for what was applied.
A message is unreadable when its value is not a contract event or its key is not the event's Id.
Reads are read_committed (the relay writes in Kafka transactions); a partition read to its end has
that end committed, past the transaction markers that no message stands for.

The consume loop and the group's callbacks are `_Cycle`'s; below it, as data: the batch in hand
(batches.py), the inserts in flight (inserts.py: two on a server, confirmed in the order sent,
a group's versions in order) and each partition's progress (progress.py). A batch's DLQ messages
go and its offsets become committable only once its insert is confirmed (`_Confirmations`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field

import psycopg
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.db import connection
from pin_pipelines.devstats.batches import Batch, BatchBuffer, position
from pin_pipelines.devstats.counters import record_loader_batch
from pin_pipelines.devstats.dlq import DeadLetters
from pin_pipelines.devstats.inserts import InsertPipeline
from pin_pipelines.devstats.offsets import (
    DEFAULT_GROUP,
    OffsetCommits,
    RenewableConsumer,
    commit_offsets,
    committed_offsets,
    first_unloaded,
    kafka_consumer,
    topic_partitions,
    unloaded_ranges,
    watermarks,
)
from pin_pipelines.devstats.progress import PartitionProgress
from pin_pipelines.devstats.replay import EVERY_GROUP, IdRange, RangedReplay
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TOPIC_DEVSTATS_DLQ, TOPIC_LAYOUT_GROUP, check_broker
from pin_pipelines.kafka_properties import failure
from pin_pipelines.quantiles import Reservoir
from pin_pipelines.tracing import links_to, tracer, tracing_enabled
from pin_pipelines.worker import Budget, check_services, never

log = logging.getLogger("pin_pipelines.devstats")

CONSUME_TIMEOUT = 0.1  # seconds; see _Cycle._next_messages
#: The longest one wait on Kafka of a continuous load with nothing in hand: librdkafka hands the
#: first message over as it arrives, so a longer wait adds no latency; it is how soon a stop,
#: the run's deadline and the group's membership are looked at meanwhile.
IDLE_WAIT_SECONDS = 0.5
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
    #: A batch is stored at the latest this long after its first event arrived: under a light
    #: flow an event is visible this long plus its insert after it reached the loader.
    batch_seconds: float = 0.25
    #: Hard bound of one cycle, and the budget of a continuous load (`inf`: until stopped); what
    #: a cycle leaves shows as lag and `complete: false`.
    max_seconds: float = 300.0
    #: ClickHouse unreachable: attempts per batch, waiting 0.5 s, 1 s, 2 s, … between them.
    attempts: int = 5
    backoff_seconds: float = 0.5
    #: Checked between polls: the cycle stores and commits the batch in hand and ends early
    #: (`complete: false`), like at max_seconds (a clean stop of `pin serve`).
    should_stop: Callable[[], bool] = never


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
    #: The freshness of a uniform sample of the inserted events, for the quantiles above.
    freshness: Reservoir = field(
        default_factory=lambda: Reservoir(FRESHNESS_SAMPLES), repr=False, compare=False
    )

    def add(self, batch: Batch) -> None:
        """A stored batch's counts and freshness."""
        self.batches += 1
        self.consumed += batch.size
        self.inserted += len(batch.fresh)
        self.skipped_stale += batch.stale
        self.dead_lettered += len(batch.bad)
        self.skipped_out_of_range += batch.outside
        for seconds in batch.freshness():
            self.freshness.add(seconds)

    def end(self, lag: dict[int, int], started: float) -> None:
        """The load is over: what it left, how long it took, its freshness quantiles."""
        self.lag = lag
        self.seconds = round(time.monotonic() - started, 3)
        self.freshness_p50_seconds = self.freshness.quantile(0.5)
        self.freshness_p99_seconds = self.freshness.quantile(0.99)
        self.freshness_max_seconds = self.freshness.max

    def as_dict(self) -> dict[str, object]:
        data = {**asdict(self), "lag": {str(p): n for p, n in sorted(self.lag.items())}}
        del data["freshness"]
        return data


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
        open_clickhouse(
            settings.clickhouse_url,
            serve=continuous,
            password_file=settings.clickhouse_password_file,
        ) as ch,
        ExitStack() as more_connections,
        RenewableConsumer(settings.kafka_bootstrap, options.group) as consumers,
        _collector_paused(),
    ):
        # ClickHouse is reached lazily, at the first batch: with nothing new in the topic a wrong
        # password passed for good. PostgreSQL is not checked: the loader's counters are best
        # effort (_Counters), never a reason to stop loading.
        check_services(
            "the dimension loader",
            [lambda: ch.rows("SELECT 1"), lambda: check_broker(settings.kafka_bootstrap)],
        )
        writers = [ch] + [
            more_connections.enter_context(
                open_clickhouse(
                    settings.clickhouse_url, password_file=settings.clickhouse_password_file
                )
            )
            for _ in range(ch.inserts_in_flight - 1)
        ]
        inserts = InsertPipeline(writers, options.attempts, options.backoff_seconds)
        confirmed = _Confirmations(
            PartitionProgress(continuous),
            OffsetCommits(lambda: consumers.current, options.topic),
            DeadLetters(settings.kafka_bootstrap, options.dlq_topic),
            counters,
        )
        summary = _Cycle(
            inserts, confirmed, consumers, settings.kafka_bootstrap, options, replay
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


class _Cycle:
    """One load: `continuous` reads every assigned partition on, past its watermark, until the
    deadline or a stop; otherwise each up to the watermark it had when assigned. The consume loop
    and the group's callbacks are here; the batches, their inserts and the partitions' progress
    are data below it (batches.py, inserts.py, progress.py)."""

    def __init__(
        self,
        inserts: InsertPipeline,
        confirmed: _Confirmations,
        consumers: RenewableConsumer,
        bootstrap: str,
        options: LoadOptions,
        replay: RangedReplay | None,
    ) -> None:
        self.inserts, self.confirmed, self.progress = inserts, confirmed, confirmed.progress
        self.bootstrap, self.options, self.replay = bootstrap, options, replay
        self.continuous = self.progress.continuous
        self.budget = Budget(options.max_seconds, options.should_stop)
        self.buffer = BatchBuffer(options.batch_size, options.batch_seconds)
        callbacks = {"on_assign": self._assigned, "on_revoke": self._revoked, "on_lost": self._lost}
        self.group = _Membership(consumers, bootstrap, options, callbacks)

    @property
    def consumer(self) -> Consumer:
        return self.group.consumers.current

    def run(self) -> LoadSummary:
        started = time.monotonic()
        partitions = topic_partitions(self.consumer, self.options.topic)
        if partitions:
            self.group.join()
            try:
                self._consume()
            finally:
                self.group.closing = True
        unloaded = unloaded_ranges(self.consumer, self.options.topic, partitions)
        summary = self.confirmed.summary
        summary.end({p: high - start for p, (start, high) in unloaded.items()}, started)
        if self.continuous:
            summary.complete = not any(summary.lag.values())
        return summary

    def _assigned(self, consumer: Consumer, assignment: list[TopicPartition]) -> None:
        """The group's share of this loader: each partition from the committed offset, until the
        high watermark of now (a cycle: those without work stay assigned, paused), or on. An
        assignment served by the close after the cycle takes nothing on: the consumer is being
        destroyed, and its committed() failed the load with `_DESTROY` (CI, a backfill run)."""
        if self.group.closing:
            return
        topic = self.options.topic
        parts = [tp.partition for tp in assignment]
        ranges = unloaded_ranges(consumer, topic, parts, warn_past_end=True)
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in ranges.items()])
        idle = [
            TopicPartition(topic, p)
            for p, (start, high) in ranges.items()
            if not self.progress.expect(p, start, high)
        ]
        if idle:
            consumer.pause(idle)
        self.group.assigned = True

    def _revoked(self, _consumer: Consumer, _revoking: list[TopicPartition]) -> None:
        """A rebalance takes the partitions (eager: all of them): store the batch in hand, commit
        what is stored, then let them go. The next owner resumes at the committed offsets. At the
        close after the cycle everything is committed already (or failed: nothing to add)."""
        if self.group.closing:
            return
        self._store_everything()
        self.confirmed.commit(asynchronous=False)
        self._forget_assignment()

    def _lost(self, _consumer: Consumer, _lost: list[TopicPartition]) -> None:
        """The session expired: the partitions are another loader's already, and a commit would
        be refused. What was not committed is replayed by the new owner (the guard skips it)."""
        self.inserts.abandon()
        self._forget_assignment()

    def _forget_assignment(self) -> None:
        self.buffer.clear()
        self.progress.forget()
        self.inserts.forget_versions()
        self.group.assigned = False

    def _consume(self) -> None:
        """Poll until every assigned partition reached its watermark (a cycle), the deadline
        passed or `should_stop` (both modes), then store what is in hand and commit."""
        try:
            self._poll_until_done()
            self._store_everything()
        finally:  # keep the progress of stored batches, also when a later batch fails
            self.confirmed.commit(asynchronous=False)
        self.confirmed.summary.complete = self.group.assigned and not self.progress.pending

    def _poll_until_done(self) -> None:
        while (self.progress.more_coming or not self.group.assigned) and not self.budget.stopping():
            if self.group.rejoined_when_overdue(continuous=self.continuous):
                continue
            messages = self._next_messages()
            for msg in messages:
                self._take(msg)
            if self.buffer.ready(more_coming=self.progress.more_coming):
                self._send(self.buffer.take(self.replay))
            elif not (messages or self.buffer) and self.continuous:
                self._caught_up()

    def _next_messages(self) -> list[Message]:
        """What librdkafka has for this load, waited for no longer than adds nothing.

        `consume(n)` returns once n messages arrived, or at its timeout with fewer: asking for
        no more than is wanted makes it return as soon as that arrived. A bounded cycle asks for
        what it has left, which can be overcounted (transaction markers take offsets and are
        never handed out), so its timeout is short: a call that returns early loops. A
        continuous load with nothing in hand waits for the first message alone, up to
        IDLE_WAIT_SECONDS, then takes whatever else is there already; with a batch in hand, it
        waits until the batch is full or due (it had waited in 0.1 s steps, holding an event
        that arrived meanwhile until the step's end)."""
        consume = self.consumer.consume
        if not self.continuous:
            wanted = max(1, min(self.buffer.room, self.progress.left()))
            return consume(num_messages=wanted, timeout=CONSUME_TIMEOUT)
        if self.buffer:
            return consume(num_messages=self.buffer.room, timeout=self.buffer.due_in())
        first = consume(num_messages=1, timeout=min(IDLE_WAIT_SECONDS, self.budget.remaining()))
        if not first or self.buffer.room == 1:
            return first
        return first + consume(num_messages=self.buffer.room - 1, timeout=0)

    def _take(self, msg: Message) -> None:
        """A consumed message into the batch in hand, an end-of-partition event into the
        progress; a bounded cycle pauses a partition read up to its start watermark."""
        err = msg.error()
        if err is not None and err.code() != KafkaError._PARTITION_EOF:
            raise PinError(failure(self.bootstrap, f"Kafka at {self.bootstrap}: {err.str()}"))
        p, offset = position(msg)
        load, finished = self.progress.read(p, offset, at_end=err is not None)
        if load:
            self.buffer.add(msg, p, offset)
        if finished:
            self.consumer.pause([TopicPartition(self.options.topic, p)])

    def _caught_up(self) -> None:
        """Nothing arrived, nothing is waiting: confirm the batch in flight (it would otherwise
        wait for the next one) and commit up to where the partitions were read (past the
        transaction markers, see PartitionProgress.skip_undelivered)."""
        self._store_everything()
        self.progress.reached.clear()
        self.confirmed.commit(asynchronous=True)
        self.confirmed.counters.record_if_due()

    def _store_everything(self) -> None:
        if self.buffer:
            self._send(self.buffer.take(self.replay))
        self.confirmed.take(self.inserts.settle())
        self.progress.skip_undelivered()

    def _send(self, batch: Batch) -> None:
        self.confirmed.take(self.inserts.send(batch))


class _Membership:
    """The load's place in its consumer group: joined with the load's rebalance callbacks and
    watched for its assignment. A bounded cycle unassigned for JOIN_TIMEOUT ends with one line;
    a continuous load joins again with a new consumer (`_rejoin`)."""

    def __init__(
        self,
        consumers: RenewableConsumer,
        bootstrap: str,
        options: LoadOptions,
        callbacks: Mapping[str, Callable[[Consumer, list[TopicPartition]], None]],
    ) -> None:
        self.consumers, self.bootstrap, self.options = consumers, bootstrap, options
        self.callbacks = callbacks
        self.assigned = False  # the group gave this loader its share (maybe none)
        self.closing = False  # the load is over: the consumer's close revokes, nothing to do
        self.unassigned_since = time.monotonic()

    def join(self) -> None:
        self.unassigned_since = time.monotonic()
        self.consumers.current.subscribe([self.options.topic], **self.callbacks)

    def rejoined_when_overdue(self, *, continuous: bool) -> bool:
        """Unassigned for JOIN_TIMEOUT: a bounded cycle fails, a continuous load joins again
        (True: nothing to poll on this turn)."""
        if self.assigned:
            self.unassigned_since = time.monotonic()
            return False
        if time.monotonic() - self.unassigned_since <= JOIN_TIMEOUT:
            return False
        if not continuous:
            raise PinError(
                failure(
                    self.bootstrap,
                    f"Kafka at {self.bootstrap}: group {self.options.group} assigned no "
                    f"partitions within {JOIN_TIMEOUT:g}s (coordinator unavailable?); stored "
                    "batches are committed, the next run resumes from there",
                )
            )
        self._rejoin()
        return True

    def _rejoin(self) -> None:
        """Out of the group for JOIN_TIMEOUT (the session lost across a partition, the
        coordinator moved): a new consumer joins in the old one's place. What the old one stored
        is committed (a revoke) or replayed by its partitions' next owner (a loss), and the
        version guard skips it either way."""
        log.warning(
            "Kafka at %s: group %s assigned no partitions within %gs; joining it again with a "
            "new consumer",
            *(self.bootstrap, self.options.group, JOIN_TIMEOUT),
        )
        self.closing = True  # the old consumer's close has nothing of this load's to revoke
        try:
            self.consumers.renew()
        finally:
            self.closing = False
        self.join()


class _Confirmations:
    """What follows a batch's storing, batch by batch in the order they were sent: its
    unreadable messages go to the DLQ, then its offsets become committable (and are committed
    asynchronously), then it is counted and traced."""

    def __init__(
        self,
        progress: PartitionProgress,
        commits: OffsetCommits,
        dead_letters: DeadLetters,
        counters: _Counters,
    ) -> None:
        self.progress, self.commits = progress, commits
        self.dead_letters, self.counters = dead_letters, counters
        self.summary = LoadSummary()

    def take(self, confirmed: Iterable[Batch]) -> None:
        for batch in confirmed:
            self.dead_letters.send(batch.bad)
            self.progress.stored(batch.ends)
            self.commit(asynchronous=True)
            self.summary.add(batch)
            self.counters.add(len(batch.fresh), batch.stale)
            self.counters.record_if_due()
            _trace(batch, self.commits.topic)

    def commit(self, *, asynchronous: bool) -> None:
        """Commit what is stored: asynchronously after each batch (a lost commit only replays
        applied events, which the guard skips), synchronously at the end, covering them all."""
        if asynchronous:
            self.commits.send(self.progress.unsent())
        else:
            self.commits.commit(self.progress.applied)


def _trace(batch: Batch, topic: str) -> None:
    """A span from the batch's decoding to its offsets, linked to the recalcs that wrote it."""
    if tracing_enabled():
        span = tracer().start_span(
            "devstats.load_batch",
            start_time=batch.started_ns,
            links=links_to(batch.origins),
            attributes={
                "topic": topic,
                "messages": batch.size,
                "inserted": len(batch.fresh),
                "dead_lettered": len(batch.bad),
            },
        )
        span.end()


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
