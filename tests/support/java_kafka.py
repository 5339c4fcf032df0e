"""The Java Kafka client's default partitioning, written independently of librdkafka, as the
oracle the relay's placement is checked against."""

from __future__ import annotations


def java_murmur2(data: bytes) -> int:
    """org.apache.kafka.common.utils.Utils.murmur2, in 32-bit two's complement arithmetic."""
    length = len(data)
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    h = (seed ^ length) & 0xFFFFFFFF
    for i in range(length // 4):
        k = int.from_bytes(data[i * 4 : i * 4 + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def java_partition(key: str, partitions: int) -> int:
    return (java_murmur2(key.encode()) & 0x7FFFFFFF) % partitions
