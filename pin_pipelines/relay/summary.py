"""What one relay run did: the CLI's JSON summary and the Dagster materialization metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RelaySummary:
    published: int = 0
    dead_lettered: int = 0
    published_by_topic: dict[str, int] = field(default_factory=dict)
    dead_lettered_by_topic: dict[str, int] = field(default_factory=dict)
    #: Highest acknowledged offset per topic and partition: the topic's new "version" for Dagster.
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    batches: int = 0
    #: Events left in the outbox at the end: committed after the start (or a broker failure).
    pending: int = 0
    #: Age of the oldest event left in the outbox at the end (0 when it is empty).
    lag_seconds: float = 0.0
    duration_seconds: float = 0.0

    def count_published(self, topic: str, partition: int, offset: int) -> None:
        self.published += 1
        self.published_by_topic[topic] = self.published_by_topic.get(topic, 0) + 1
        partitions = self.offsets.setdefault(topic, {})
        partitions[partition] = max(partitions.get(partition, -1), offset)

    def count_dead_lettered(self, topic: str) -> None:
        self.dead_lettered += 1
        self.dead_lettered_by_topic[topic] = self.dead_lettered_by_topic.get(topic, 0) + 1

    def as_dict(self) -> dict[str, object]:
        """JSON-ready (partition numbers become string keys, as JSON requires)."""
        data = asdict(self)
        data["offsets"] = {
            topic: {str(p): o for p, o in sorted(parts.items())}
            for topic, parts in self.offsets.items()
        }
        data["lag_seconds"] = round(self.lag_seconds, 3)
        data["duration_seconds"] = round(self.duration_seconds, 3)
        return data
