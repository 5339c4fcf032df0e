"""The relay's Kafka side: an idempotent producer and one batch sent with its delivery reports.

A batch is bounded in time: librdkafka fails each message after `message.timeout.ms`, so
`flush` returns with a report (success or error) for every message of the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from pin_pipelines.relay.log import log_event

#: Key + value bytes above which an event is dead-lettered before it is sent. Below the broker's
#: default `message.max.bytes` (1 MiB + 12) with room for the record and batch headers.
MAX_MESSAGE_BYTES = 1_000_000

#: Delivery errors no retry can fix: the event is dead-lettered instead of blocking its bucket.
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
    }
)

#: (error, message) per sent event; error is None when the broker acknowledged it.
Report = tuple[KafkaError | None, Message | None]


def new_producer(bootstrap: str, delivery_timeout: float) -> Producer:
    """Idempotent producer: retries cannot duplicate or reorder messages of one partition."""
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": int(delivery_timeout * 1000),
            "error_cb": _log_client_error,
            # librdkafka would print every refused connection on stderr; errors reach the caller
            # through the delivery reports instead.
            "log_level": 0,
        }
    )


def send(
    producer: Producer, messages: Sequence[tuple[str, str, bytes]], timeout: float
) -> list[Report]:
    """Produce (topic, key, value) messages and wait for every delivery report, within `timeout`."""
    reports: list[Report | None] = [None] * len(messages)
    deadline = time.monotonic() + timeout
    for index, (topic, key, value) in enumerate(messages):
        callback = partial(_store, reports, index)
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=callback)
                break
            except BufferError:  # local queue full: let librdkafka drain it, within the deadline
                if time.monotonic() > deadline:
                    reports[index] = (KafkaError(KafkaError._MSG_TIMED_OUT), None)
                    break
                producer.poll(0.05)
            except KafkaException as exc:  # refused before sending (e.g. too large)
                reports[index] = (exc.args[0], None)
                break
    if producer.flush(max(deadline - time.monotonic(), 0)) > 0:
        producer.purge()  # the rest fail with _PURGE_* reports; they stay in the outbox
        producer.flush(0)
    timed_out: Report = (KafkaError(KafkaError._MSG_TIMED_OUT), None)
    return [report or timed_out for report in reports]


def _store(reports: list[Report | None], index: int, err: KafkaError | None, msg: Message) -> None:
    reports[index] = (err, msg)


def _log_client_error(err: Any) -> None:
    log_event(logging.DEBUG, "kafka_client_error", error=str(err))
