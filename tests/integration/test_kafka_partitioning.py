"""Keys land on the partition the Java client would pick, on the real broker."""

from __future__ import annotations

import uuid

from confluent_kafka import Message, Producer
from confluent_kafka.admin import NewTopic

from pin_pipelines.kafka import admin, delete_topics
from pin_pipelines.relay.producer import producer_config
from tests.support.java_kafka import java_partition


def test_sample_keys_land_where_java_puts_them(kafka_bootstrap: str) -> None:
    """Tried: 300 random lowercase UUID keys (the contract's message keys) produced with the
    relay's producer settings to a fresh 6-partition topic; every message is on the partition
    the Java formula gives."""
    topic = f"pin.test.partitioning.{uuid.uuid4().hex[:10]}"
    client = admin(kafka_bootstrap)  # kept: its futures die with it
    client.create_topics([NewTopic(topic, 6, 1)])[topic].result(timeout=15)
    placed: dict[str, int] = {}

    def delivered(err: object, msg: Message) -> None:
        assert err is None, err
        placed[bytes(msg.key() or b"").decode()] = int(msg.partition() or 0)

    try:
        producer = Producer(producer_config(kafka_bootstrap, 10.0))
        keys = [str(uuid.uuid4()) for _ in range(300)]
        for key in keys:
            producer.produce(topic, b"{}", key, on_delivery=delivered)
        assert producer.flush(15) == 0
    finally:
        delete_topics(kafka_bootstrap, (topic,))
    assert placed == {key: java_partition(key, 6) for key in keys}
