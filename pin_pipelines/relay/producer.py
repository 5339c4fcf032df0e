"""The relay's Kafka side: a transactional producer that reports failed deliveries only.

Every batch is one Kafka transaction: `begin`, `send` its events and its receipt,
`wait` for the failures, then `commit` or `abort`. A read_committed consumer sees a batch whole
or not at all, so a batch sent again after a failure never shows twice, and per key the Version
never goes down. The `transactional.id` is stable: the producer's `init_transactions` fences any
older producer with the same id and aborts its unfinished transaction (or waits for its commit to
complete), so a relay that died, hung or lost its broker cannot add to the topics afterwards.

librdkafka reports per message; with `delivery.report.only.error` it calls back for failures
alone, so after a complete `flush` every produced message without a failure report was
acknowledged by the broker (`acks=all`). A report per message cost the relay more than the
produce call itself (bench/bench_relay.py: 0.45 s per 200k events of a 1.6 s relay), and the
relay only needs the exceptions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from pin_pipelines.errors import PinError
from pin_pipelines.kafka import client_config
from pin_pipelines.kafka_properties import failure

#: Key + value bytes above which an event is dead-lettered before it is sent. Below the broker's
#: default `message.max.bytes` (1 MiB + 12) with room for the record and batch headers.
MAX_MESSAGE_BYTES = 1_000_000

#: Delivery errors no retry can fix: the event is dead-lettered instead of blocking the outbox.
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
    }
)

#: What librdkafka reports for a message it took back unsent when the transaction failed.
PURGED_ERRORS = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})

#: What a producer gets once a newer one with its transactional.id called init_transactions.
FENCED_ERRORS = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)

#: Seconds an abort may take. An abort follows a failure, when the broker may well be gone; one
#: that does not finish is harmless (the next producer's init_transactions aborts the transaction),
#: so it is not worth waiting the whole delivery timeout for.
ABORT_TIMEOUT = 5.0

#: Seconds the broker lets a transaction stay open beyond the delivery timeout before it aborts
#: it itself: room for the batch's PostgreSQL statements between the flush and the commit. Also
#: how long read_committed consumers of a partition can stall behind a relay that died
#: mid-transaction when no new relay starts (a new one aborts the transaction at once).
TRANSACTION_MARGIN = 60.0


def producer_config(bootstrap: str, delivery_timeout: float) -> dict[str, Any]:
    """The relay's producer settings, less the transaction and the failure reports (also
    bench/bench_relay.py's same-settings baseline)."""
    return {
        **client_config(bootstrap),
        # Implied by transactions; said here because the order per key rests on it.
        "enable.idempotence": True,
        "acks": "all",
        # A backlog is sent in fewer, fuller requests: a third of the broker's CPU per event on
        # this 2-core machine (measured), where the broker shares the cores with the relay and
        # PostgreSQL. `flush` sends at once, so a batch never waits for it.
        "linger.ms": 20,
        "compression.type": "lz4",
        "message.timeout.ms": int(delivery_timeout * 1000),
        # The Java client's partitioner (murmur2 of the key; librdkafka's default is CRC32): a
        # key lands on the partition Java producers (Debezium, Kafka Streams) pick for it, so
        # the topics can be shared with them and joined co-partitioned.
        "partitioner": "murmur2_random",
    }


@dataclass(frozen=True, slots=True)
class Failure:
    """A message the broker did not acknowledge (or librdkafka refused to send)."""

    error: KafkaError
    value: bytes

    @property
    def permanent(self) -> bool:
        return self.error.code() in PERMANENT_ERRORS

    @property
    def purged(self) -> bool:
        """Taken back by librdkafka unsent (or unanswered) when the transaction failed: after a
        permanent refusal the transaction is abortable, and what was still queued behind the
        refused event is purged rather than sent. Whether that happens depends on timing: on an
        idle machine the rest of the batch was acknowledged first; under load it was not."""
        return self.error.code() in PURGED_ERRORS


class Sender:
    """One transactional producer: `begin`, `send`, `wait` for the failures, `commit`/`abort`.

    Producing is asynchronous: librdkafka sends in its own threads while the caller fetches the
    next rows. Raises PinError (one line) when the broker does not answer or took the
    transactional.id over; the caller then drops the Sender (a new one fences this one).
    """

    def __init__(self, bootstrap: str, transactional_id: str, delivery_timeout: float) -> None:
        self.bootstrap = bootstrap
        self.transactional_id = transactional_id
        self.timeout = delivery_timeout + 5
        self.in_transaction = False
        self._failures: list[Failure] = []
        self.producer = Producer(
            {
                **producer_config(bootstrap, delivery_timeout),
                "transactional.id": transactional_id,
                "transaction.timeout.ms": int((delivery_timeout + TRANSACTION_MARGIN) * 1000),
                "delivery.report.only.error": True,
                "on_delivery": self._delivery_failed,
            }
        )
        try:
            # Connected first: init_transactions looks the coordinator up at once and, with no
            # broker connection up yet, tries again only 500 ms later (one start in eight).
            self.producer.list_topics(timeout=self.timeout)
            self.producer.init_transactions(self.timeout)
        except KafkaException as exc:
            raise PinError(
                failure(
                    bootstrap,
                    f"Kafka at {bootstrap} did not start the relay's transactional producer"
                    f" ({transactional_id}) within {self.timeout:g}s: {_describe(exc)}",
                    self.producer,
                )
            ) from exc

    def begin(self) -> None:
        self._failures = []  # reports of an aborted transaction's purged messages
        try:
            self.producer.begin_transaction()
        except KafkaException as exc:  # fenced, or failed for good, since the last batch
            error: KafkaError = exc.args[0]
            raise self._fatal(error) from exc
        self.in_transaction = True

    def send(
        self,
        topic: str,
        key: str,
        value: bytes,
        partition: int = -1,
        timestamp_ms: int = 0,
        traceparent: str | None = None,
    ) -> None:
        """Runs once per event: the common case is one librdkafka call. `timestamp_ms` 0 lets
        librdkafka stamp the message; a traceparent travels as the W3C header of that name."""
        headers: list[tuple[str, str | bytes | None]] | None = (
            [("traceparent", traceparent)] if traceparent else None
        )
        try:
            self.producer.produce(
                topic, value, key, partition, timestamp=timestamp_ms, headers=headers
            )
        except BufferError:  # local queue full: let librdkafka drain it, within the timeout
            self._send_when_room(topic, key, value, partition, timestamp_ms, headers)
        except KafkaException as exc:  # refused before sending (e.g. too large)
            self._failures.append(Failure(exc.args[0], value))

    def _send_when_room(
        self,
        topic: str,
        key: str,
        value: bytes,
        partition: int,
        timestamp_ms: int,
        headers: list[tuple[str, str | bytes | None]] | None,
    ) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            self.producer.poll(0.05)
            try:
                self.producer.produce(
                    topic, value, key, partition, timestamp=timestamp_ms, headers=headers
                )
                return
            except BufferError:
                if time.monotonic() > deadline:
                    self._failures.append(Failure(KafkaError(KafkaError._MSG_TIMED_OUT), value))
                    return
            except KafkaException as exc:
                self._failures.append(Failure(exc.args[0], value))
                return

    def wait(self) -> list[Failure]:
        """The failures among the messages sent in this transaction; the others were
        acknowledged. Returns within the timeout: librdkafka fails each message after
        `message.timeout.ms`, and what it still holds after that counts as one failure (the
        transaction is then aborted, which purges it)."""
        left = self.producer.flush(self.timeout)
        failures, self._failures = self._failures, []
        if left:
            failures.append(
                Failure(
                    KafkaError(
                        KafkaError._MSG_TIMED_OUT,
                        f"{left} messages unacknowledged after {self.timeout:g}s",
                    ),
                    b"",
                )
            )
        return failures

    def commit(self) -> None:
        """Commit, retrying while librdkafka says the call may be resumed, up to the timeout.

        A commit that times out may still complete on the broker: the caller keeps its rows and
        drops this producer; the next one's init_transactions waits for the commit to finish and
        the receipt then tells which way it went."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.producer.commit_transaction(max(1.0, deadline - time.monotonic()))
                self.in_transaction = False
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal():
                    raise self._fatal(error) from exc
                resumable = error.retriable() and not error.txn_requires_abort()
                if not resumable or time.monotonic() >= deadline:
                    raise PinError(
                        f"Kafka at {self.bootstrap} did not acknowledge the commit of a"
                        f" transaction within {self.timeout:g}s ({error.str()}); its events stay"
                        " in the outbox unless the commit completed, which the next relay learns"
                        " from its receipt"
                    ) from exc

    def abort(self) -> None:
        """Abort the open transaction; its messages never reach a read_committed consumer."""
        try:
            self.producer.abort_transaction(ABORT_TIMEOUT)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
                raise self._fatal(error) from exc
            raise PinError(
                f"Kafka at {self.bootstrap} did not abort a transaction within"
                f" {ABORT_TIMEOUT:g}s ({error.str()}); the next relay's producer aborts it"
            ) from exc
        finally:  # tried once: if it failed, the next producer's init_transactions aborts it
            self.in_transaction = False
            self._failures = []

    def abort_quietly(self) -> None:
        """After a failure elsewhere: end an open transaction now rather than when the next
        producer starts or the broker times it out (read_committed consumers wait for it).
        Failing is fine: the caller drops this producer either way."""
        if self.in_transaction:
            with contextlib.suppress(PinError, KafkaException):
                self.abort()

    def _fatal(self, error: KafkaError) -> PinError:
        """The producer is unusable for good; usually a newer one with the same id fenced it."""
        if error.code() in FENCED_ERRORS:
            return PinError(
                f"another relay with transactional.id {self.transactional_id} took over Kafka at"
                f" {self.bootstrap}, or this one's transaction outlived its timeout"
                f" ({error.str()}); this one stopped, its batch stays in the outbox"
            )
        return PinError(f"Kafka at {self.bootstrap} failed the relay's producer: {error.str()}")

    def _delivery_failed(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:  # only failures are reported; the check keeps that explicit
            self._failures.append(Failure(err, msg.value() or b""))


def _describe(exc: KafkaException) -> str:
    error = exc.args[0]
    return error.str() if isinstance(error, KafkaError) else str(error)
