"""The loader's dead-letter queue: unreadable messages go to the DLQ topic as they came, with why
and where from in their headers (error, source-topic, source-partition, source-offset), so a
backfill's repeats are recognisable. The loader commits a batch's offsets only after `send`
returned: a message is never skipped without being dead-lettered."""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import KafkaError, Message, Producer

from pin_pipelines.devstats.offsets import KAFKA_TIMEOUT
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import client_config


class DeadLetters:
    """A producer to `topic`, made on the first unreadable message (most cycles have none)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._producer: Producer | None = None

    def send(self, bad: Sequence[tuple[Message, str]]) -> None:
        """Produce `(message, why)` pairs and wait until the broker acknowledged every one."""
        if not bad:
            return
        if self._producer is None:
            self._producer = Producer(client_config(self.bootstrap, {"enable.idempotence": True}))
        failures: list[str] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failures.append(err.str())

        for msg, error in bad:
            self._producer.produce(
                self.topic,
                key=msg.key(),
                value=msg.value(),
                on_delivery=delivered,
                headers=[
                    ("error", error.encode()),
                    ("source-topic", (msg.topic() or "").encode()),
                    ("source-partition", str(msg.partition()).encode()),
                    ("source-offset", str(msg.offset()).encode()),
                ],
            )
        left = self._producer.flush(KAFKA_TIMEOUT)
        if left or failures:
            raise PinError(
                f"could not write {left + len(failures)} unreadable events to {self.topic} at "
                f"{self.bootstrap}{': ' + failures[0] if failures else ''}; this batch's offsets "
                "are not committed"
            )
