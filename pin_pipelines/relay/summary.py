"""What one relay run did: the CLI's JSON summary and the Dagster materialization metadata."""

from __future__ import annotations

from collections.abc import Mapping
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

    def add_batch(
        self,
        published: Mapping[str, int],
        dead_lettered: Mapping[str, int],
        offsets: Mapping[tuple[str, int], int],
    ) -> None:
        """A batch's counts per topic and its last offset per (topic, partition)."""
        self._add(published, dead_lettered, offsets)
        self.batches += 1

    def merge(self, later: RelaySummary) -> None:
        """Fold a later run in (a job relaying several times reports one total): counts add up,
        the backlog is the later run's."""
        offsets = {(t, p): o for t, parts in later.offsets.items() for p, o in parts.items()}
        self._add(later.published_by_topic, later.dead_lettered_by_topic, offsets)
        self.batches += later.batches
        self.pending, self.lag_seconds = later.pending, later.lag_seconds
        self.duration_seconds += later.duration_seconds

    def _add(
        self,
        published: Mapping[str, int],
        dead_lettered: Mapping[str, int],
        offsets: Mapping[tuple[str, int], int],
    ) -> None:
        for topic, count in published.items():
            self.published += count
            self.published_by_topic[topic] = self.published_by_topic.get(topic, 0) + count
        for topic, count in dead_lettered.items():
            self.dead_lettered += count
            self.dead_lettered_by_topic[topic] = self.dead_lettered_by_topic.get(topic, 0) + count
        for (topic, partition), offset in offsets.items():
            partitions = self.offsets.setdefault(topic, {})
            partitions[partition] = max(partitions.get(partition, -1), offset)

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
