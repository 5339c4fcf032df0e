"""The relay's partitioner is the Java client's; the oracle is checked against the
vectors of Kafka's own UtilsTest.testMurmur2 (the Java client's values, signed 32-bit)."""

from __future__ import annotations

import pytest

from pin_pipelines.relay.producer import producer_config
from tests.support.java_kafka import java_murmur2

KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("data", "signed"), KAFKA_VECTORS.items())
def test_the_murmur2_oracle_matches_the_java_client(data: bytes, signed: int) -> None:
    assert java_murmur2(data) == signed & 0xFFFFFFFF


def test_the_relay_uses_the_java_partitioner() -> None:
    assert producer_config("127.0.0.1:9092", 5.0)["partitioner"] == "murmur2_random"
