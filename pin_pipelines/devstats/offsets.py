"""The loader group's place in the layout-group topic: its consumer, the partitions, their
watermarks, the group's committed offsets and where loading resumes. The loader writes offsets
(`commit_offsets`); the lag readers (freshness, metrics) only read them, with a consumer of the
same group that never joins it.

Calls that a broker answers with a settling error (a leader being elected, a coordinator loading,
right after a topic's creation or a restart) are retried for up to KAFKA_TIMEOUT
(`kafka.while_settling`); anything else surfaces as a one-line PinError.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from pin_pipelines.config import DEAD_PEER_SECONDS
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import client_config, while_settling
from pin_pipelines.kafka_properties import failure

log = logging.getLogger("pin_pipelines.devstats")

DEFAULT_GROUP = "pin-devstats-dim-layout-group"
KAFKA_TIMEOUT = 10.0
#: How long a synchronous commit waits for the group's coordinator. When the broker holding it
#: dies, the coordinator moves only after that broker's session expires (9 s by default, 6 s in
#: the local cluster), a new leader of its `__consumer_offsets` partition is elected and the
#: group's offsets are loaded there: past KAFKA_TIMEOUT under load (a CI failure). The batch is
#: stored already, so waiting beats failing a run that a failover would otherwise survive.
COMMIT_TIMEOUT = 3 * KAFKA_TIMEOUT
#: A consumer's close (leave the group, wait for its commits) longer than this is given up on.
CLOSE_TIMEOUT = 2 * KAFKA_TIMEOUT


@contextmanager
def kafka_consumer(bootstrap: str, group: str) -> Iterator[Consumer]:
    """A consumer of the loader's group; commits only by the loader. The lag readers assign
    partitions explicitly (they never join the group), the loader subscribes."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
            # The relay writes in Kafka transactions: only committed events may reach the
            # dimension, never those of an aborted or still open transaction. librdkafka's default
            # already, stated because the loader's correctness depends on it.
            "isolation.level": "read_committed",
            # A short fetch long-poll: offset requests for the lag queue behind a pending fetch.
            "fetch.wait.max.ms": 100,
            # librdkafka spaces its connection attempts by half of this backoff: with the default
            # 100 ms, each new consumer's metadata and coordinator requests waited ~50 ms for a
            # connection ("still suppressed for 49ms" in its debug log), on every cycle. Retries
            # still back off exponentially up to reconnect.backoff.max.ms.
            "reconnect.backoff.ms": 10,
            # A loader killed outright holds its partitions until its session expires (default
            # 45 s): the freshness budget across a loader's death is this, not the default.
            "session.timeout.ms": 10000,
            # A member learns of a rebalance (another loader joined, or left at its run's end)
            # from its next heartbeat: at the default 3 s the hand-over of the long-lived load
            # runs stalled the load leg 3-4 s while the successor waited for its heartbeat to
            # rejoin (tests/integration/test_handover.py: 1.1-2.6 s at 2 s). Not 1 s:
            # then librdkafka no longer rejoined by itself within 30 s of a 30 s partition's
            # heal (test_partitions.py, defaults: 2 runs of 2; 5.5 s at 2 s and 3 s).
            "heartbeat.interval.ms": 2000,
            # A request unanswered this long fails and its connection is re-made (default 60 s):
            # across a partition (a blackholed broker, no RST) the loader's fetch, heartbeat and
            # FindCoordinator requests sat on dead connections for a minute after the heal,
            # and the group went on without it meanwhile.
            "socket.timeout.ms": DEAD_PEER_SECONDS * 1000,
            "socket.keepalive.enable": True,
        }
    )
    with kafka_errors(bootstrap):
        try:
            with kafka_errors(bootstrap, consumer):  # its cause is read before it is closed
                yield consumer
        except BaseException:
            with suppress(PinError, KafkaException):  # the error in flight says more
                _close(consumer, bootstrap)
            raise
        _close(consumer, bootstrap)


class RenewableConsumer:
    """A consumer of the loader's group (`kafka_consumer`) that a continuous load can trade for
    a new one (`renew`) when the group has not taken it back for long after losing it.

    librdkafka rejoins by itself once its requests fail over (socket.timeout.ms), but a consumer
    that lost its session across a partition has more than one way to stay out (a coordinator
    lookup on a connection that died, a close of its old generation that never ended): a new
    client with new connections is the one step that always gets back in."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self.bootstrap, self.group = bootstrap, group
        self._lifetime = ExitStack()
        self._current: Consumer | None = None

    @property
    def current(self) -> Consumer:
        if self._current is None:
            raise RuntimeError("RenewableConsumer used outside its `with` block")
        return self._current

    def __enter__(self) -> RenewableConsumer:
        self._current = self._lifetime.enter_context(kafka_consumer(self.bootstrap, self.group))
        return self

    def __exit__(self, *exc_info: object) -> bool | None:
        return self._lifetime.__exit__(*exc_info)  # type: ignore[arg-type]

    def renew(self) -> Consumer:
        """Close the current consumer (within CLOSE_TIMEOUT: a close that cannot reach the
        coordinator is left behind, as at a load's end) and open a new one."""
        old, self._lifetime = self._lifetime, ExitStack()
        try:
            old.close()
        except (PinError, KafkaException) as exc:
            log.warning("the consumer given up on did not close: %s", exc)
        self._current = self._lifetime.enter_context(kafka_consumer(self.bootstrap, self.group))
        return self._current


def _close(consumer: Consumer, bootstrap: str) -> None:
    """Close `consumer` (leave the group, flush its commits) within CLOSE_TIMEOUT.

    librdkafka's close has no timeout: with the group's coordinator gone (its only broker killed
    after a cycle's asynchronous commits were sent) it waits for those commits for as long as the
    broker stays down, and the load run hung with it. The close runs in a daemon thread; past the
    bound it is left there (the process ends without it), and the loader reports the broker in
    one line. Nothing is lost: a commit that did not reach the broker only replays applied events,
    which the version guard skips.
    """
    failure: list[BaseException] = []

    def close() -> None:
        try:
            consumer.close()
        except BaseException as exc:  # raised in this thread, re-raised in the caller's
            failure.append(exc)

    closer = threading.Thread(target=close, name="kafka-consumer-close", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT)
    if closer.is_alive():
        raise PinError(
            f"Kafka at {bootstrap}: the consumer did not close within {CLOSE_TIMEOUT:g}s (the "
            "group's coordinator is unreachable); what it did not commit is loaded again, "
            "without duplicates, by the next run"
        )
    if failure:
        raise failure[0]


def first_unloaded(committed: int, low: int, high: int) -> int:
    """The group's next offset within [low, high]. No commit yet (negative) or one below the
    retention start reads from `low`; one past the end (the topic was recreated or the broker's
    data reset) also replays from `low`: stalling there would starve the dimension silently,
    and the version guard makes the replay idempotent."""
    return low if committed > high else max(committed, low)


def topic_partitions(consumer: Consumer, topic: str) -> list[int]:
    """The topic's partitions; none when the topic does not exist yet (nothing to load)."""
    metadata = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        return []
    return sorted(found.partitions)


def watermarks(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
    """The partition's low and high watermarks, read from its leader (a leader still being
    elected, right after the topic's creation or a broker's restart, is waited for)."""
    wanted = TopicPartition(topic, partition)
    low, high = while_settling(
        lambda left: consumer.get_watermark_offsets(wanted, timeout=left, cached=False),
        KAFKA_TIMEOUT,
    )
    return int(low), int(high)


def committed_offsets(
    consumer: Consumer, topic: str, partitions: Sequence[int]
) -> list[TopicPartition]:
    """The group's committed offsets (a coordinator still loading after a restart is waited for)."""
    wanted = [TopicPartition(topic, p) for p in partitions]
    return while_settling(lambda left: consumer.committed(wanted, timeout=left), KAFKA_TIMEOUT)


#: What a commit is refused with when the group no longer counts this consumer as a member of its
#: current generation: the coordinator expired its session (a coordinator's failover can outlast
#: session.timeout.ms) or a rebalance went on without it.
_NOT_A_MEMBER = frozenset(
    {
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.FENCED_INSTANCE_ID,
    }
)


def no_longer_a_member(exc: BaseException) -> bool:
    """Whether a commit failed because the consumer is not the group's member any more: nothing
    to retry, its partitions are being reassigned and their next owner resumes at the last
    committed offsets. Any other failure (Kafka unreachable, not a Kafka error) is not."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(error, KafkaError) and error.code() in _NOT_A_MEMBER


def commit_offsets(consumer: Consumer, offsets: list[TopicPartition]) -> None:
    done = while_settling(
        lambda _left: consumer.commit(offsets=offsets, asynchronous=False), COMMIT_TIMEOUT
    )
    for tp in done or []:
        if tp.error is not None:
            raise PinError(f"committing offset {tp.offset} of partition {tp.partition}: {tp.error}")


class OffsetCommits:
    """A load's commits of its stored offsets (partition → next offset) on the consumer it
    holds now (`consumer`: a continuous load may renew it): asynchronously after each batch, a
    lost one only replays applied events, which the guard skips; synchronously at the end and
    before a revoke, covering them all."""

    def __init__(self, consumer: Callable[[], Consumer], topic: str) -> None:
        self.consumer, self.topic = consumer, topic
        #: A synchronous commit failed after waiting COMMIT_TIMEOUT for the group's coordinator:
        #: the load is failing, and its end's commit would only wait as long again.
        self.failed = False

    def send(self, offsets: Mapping[int, int]) -> None:
        if offsets:
            self.consumer().commit(offsets=self._partitions(offsets), asynchronous=True)

    def commit(self, offsets: Mapping[int, int]) -> None:
        if not offsets or self.failed:
            return
        try:
            commit_offsets(self.consumer(), self._partitions(offsets))
        except (KafkaException, PinError) as exc:
            if not no_longer_a_member(exc):
                self.failed = True
                raise
            # As after a lost session: the stored batches are replayed by the partitions' next
            # owner (this loader after it rejoins, or another), and the version guard skips them.
            log.warning(
                "offsets not committed, the group moved on without this loader: %s",
                exc.args[0].str(),
            )

    def _partitions(self, offsets: Mapping[int, int]) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p, o) for p, o in offsets.items()]


def unloaded_ranges(
    consumer: Consumer, topic: str, partitions: Sequence[int], *, warn_past_end: bool = False
) -> dict[int, tuple[int, int]]:
    """Partition → the group's next offset and the high watermark: what it has not loaded.
    The loader has a committed offset past the end logged (`warn_past_end`): it replays."""
    ranges = {}
    for tp in committed_offsets(consumer, topic, partitions) if partitions else []:
        low, high = watermarks(consumer, topic, tp.partition)
        ranges[tp.partition] = (first_unloaded(tp.offset, low, high), high)
        if warn_past_end and tp.offset > high:
            log.warning(
                "committed offset %s of %s[%s] is past its end %s: replaying from %s",
                *(tp.offset, topic, tp.partition, high, low),
            )
    return ranges


@contextmanager
def kafka_errors(bootstrap: str, client: Consumer | None = None) -> Iterator[None]:
    """librdkafka's exceptions (broker down, timeouts) as one-line PinErrors, naming the cause
    `client` was told of (a wrong password, an untrusted certificate) when there is one."""
    try:
        yield
    except KafkaException as exc:
        detail = f"Kafka at {bootstrap}: {exc.args[0].str()}"
        raise PinError(failure(bootstrap, detail, client)) from exc
