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
from collections.abc import Callable
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
    #: The newest created_at (epoch ms) of the rows it published; None in receipts written
    #: before it was recorded. A row created later, under an id of the runs, is another row.
    created_upto_ms: int | None = None

    @property
    def events(self) -> int:
        """Events the transaction published: every id of each run was sent (_id_runs)."""
        return sum(last - first + 1 for first, last in zip(self.firsts, self.lasts, strict=True))


def encode(seq: int, firsts: list[int], lasts: list[int], created_upto_ms: int) -> bytes:
    """The receipt of transaction `seq`: the runs of consecutive ids it published, and the
    newest of their rows' created_at."""
    return json.dumps(
        {"seq": seq, "first_ids": firsts, "last_ids": lasts, "created_upto_ms": created_upto_ms}
    ).encode()


def decode(value: bytes) -> Receipt:
    data = json.loads(value)
    upto = data.get("created_upto_ms")
    return Receipt(
        int(data["seq"]),
        list(data["first_ids"]),
        list(data["last_ids"]),
        None if upto is None else int(upto),
    )


def last_receipt(bootstrap: str, key: str, timeout: float) -> Receipt | None:
    """The last committed receipt with this key, or None when there is none.

    Call it after init_transactions: that aborted this transactional.id's unfinished transaction
    or waited for its commit to complete, so what a read_committed consumer sees is final.
    """
    found = _receipts(bootstrap, key, timeout, enough=lambda tail: bool(tail))
    return found[-1] if found else None


def receipts_after(bootstrap: str, key: str, seq: int, timeout: float) -> list[Receipt]:
    """Every committed receipt with this key above `seq`, in seq order: what Kafka holds beyond
    a PostgreSQL that lost whole transactions (failed over to a standby that lagged, restored
    from a backup). The topic is compacted: once a segment is closed only a key's last receipt
    stays in it, so an older one may be gone (the caller sees the gap in the seqs)."""
    found = _receipts(
        bootstrap, key, timeout, enough=lambda tail: bool(tail) and tail[0].seq <= seq + 1
    )
    return [receipt for receipt in found if receipt.seq > seq]


def _receipts(
    bootstrap: str, key: str, timeout: float, enough: Callable[[list[Receipt]], bool]
) -> list[Receipt]:
    """The receipts with this key in the last TAIL messages, or in the whole topic when those
    are not `enough`."""
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
            return []
        tail = max(low, high - TAIL)
        found = _with_key(consumer, key, tail, deadline)
        if not enough(found) and tail > low:
            found = _with_key(consumer, key, low, deadline)
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
    return found


def _with_key(consumer: Consumer, key: str, start: int, deadline: float) -> list[Receipt]:
    """The receipts with `key` from `start` to the end of the partition, in order."""
    consumer.assign([TopicPartition(TOPIC_RELAY_COMMITS, RECEIPT_PARTITION, start)])
    wanted = key.encode()
    found: list[Receipt] = []
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
            found.append(decode(msg.value() or b""))
    raise TimeoutError("the end of the topic was not reached")
