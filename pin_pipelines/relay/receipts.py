"""Receipts: what each Kafka transaction of the relay published, written inside it.

Kafka cannot be asked whether a transaction committed. So every transaction of the relay ends
with one message on `pin.chessboard.outbox-relay-commits.v1` saying which outbox ids it published
and its sequence number: the receipt is visible to a read_committed consumer exactly when the
transaction's events are. PostgreSQL records the seq of the last transaction whose rows were
deleted; a relay that starts finds the last receipt and compares (pin_pipelines/relay/outbox.py).

The receipt's key is `<transactional.id>/<outbox id>`: the outbox id is random per database
(chessboard.outbox_relay_commits), so a database created again under the same name, or another
one whose relay shares the transactional.id and the Kafka cluster, never reads a receipt whose
ids name its own, unrelated rows. The topic is compacted: the last receipt per key stays.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TOPIC_RELAY_COMMITS, client_config
from pin_pipelines.kafka_properties import failure

#: The receipts' only partition: the last receipt written is the last message.
RECEIPT_PARTITION = 0

#: Messages read back from the end for the last receipt. One relay publishes at a time, so ours
#: is normally the very last; only when none of ours is among them is the topic read whole.
TAIL = 64


@dataclass(frozen=True)
class Receipt:
    seq: int
    firsts: list[int]
    lasts: list[int]


def encode(seq: int, firsts: list[int], lasts: list[int]) -> bytes:
    """The receipt of transaction `seq`: the runs of consecutive ids it published."""
    return json.dumps({"seq": seq, "first_ids": firsts, "last_ids": lasts}).encode()


def decode(value: bytes) -> Receipt:
    data = json.loads(value)
    return Receipt(int(data["seq"]), list(data["first_ids"]), list(data["last_ids"]))


def last_receipt(bootstrap: str, key: str, timeout: float) -> Receipt | None:
    """The last committed receipt with this key, or None when there is none.

    Call it after init_transactions: that aborted this transactional.id's unfinished transaction
    or waited for its commit to complete, so what a read_committed consumer sees is final.
    """
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": "pin-outbox-relay-recovery",  # never joined nor committed: assign() only
            "enable.auto.commit": False,
            # Receipts of aborted transactions are not receipts: their events were never visible.
            "isolation.level": "read_committed",
            # The end is an event, not an offset: commit markers take offsets and are never
            # handed out, so "the last message's offset + 1 = the high watermark" never holds.
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 10,  # at the end, the broker answers at once rather than in 0.5 s
        }
    )
    deadline = time.monotonic() + timeout
    try:
        partition = TopicPartition(TOPIC_RELAY_COMMITS, RECEIPT_PARTITION)
        low, high = consumer.get_watermark_offsets(partition, timeout=timeout, cached=False)
        if high <= low:
            return None
        tail = max(low, high - TAIL)
        found = _last_with_key(consumer, key, tail, deadline)
        if found is None and tail > low:
            found = _last_with_key(consumer, key, low, deadline)
    except (KafkaException, TimeoutError) as exc:
        raise PinError(
            failure(
                bootstrap,
                f"Kafka at {bootstrap} did not answer the relay's receipt lookup on"
                f" {TOPIC_RELAY_COMMITS} within {timeout:g}s: {exc.args[0] if exc.args else exc!r}",
                consumer,
            )
        ) from exc
    finally:
        consumer.close()
    return None if found is None else decode(found)


def _last_with_key(consumer: Consumer, key: str, start: int, deadline: float) -> bytes | None:
    """The value of the last message with `key` from `start` to the end of the partition."""
    consumer.assign([TopicPartition(TOPIC_RELAY_COMMITS, RECEIPT_PARTITION, start)])
    wanted = key.encode()
    found: bytes | None = None
    while time.monotonic() < deadline:
        # poll, not consume(n): a batch call waits out its timeout unless n messages came.
        msg = consumer.poll(min(1.0, max(0.0, deadline - time.monotonic())))
        if msg is None:
            continue
        error = msg.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return found
            raise KafkaException(error)
        if msg.key() == wanted:
            found = msg.value()
    raise TimeoutError("the end of the topic was not reached")
