"""What one relay run did: the CLI's JSON summary and the Dagster materialization metadata.

Mergeable (pin_pipelines.worker): a continuous relay's runs fold into one summary of the same
shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from pin_pipelines.quantiles import Reservoir

#: Delivery lags kept per summary (a uniform sample beyond that).
LAG_SAMPLE = 5000


@dataclass
class RelaySummary:
    published: int = 0
    dead_lettered: int = 0
    published_by_topic: dict[str, int] = field(default_factory=dict)
    dead_lettered_by_topic: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    #: Events a previous relay published in a Kafka transaction that committed while its
    #: PostgreSQL transaction did not: deleted from the outbox (and counted) by this run's recovery.
    recovered: int = 0
    #: Events left in the outbox at the end: committed after the start (or a broker failure).
    pending: int = 0
    #: Age of the oldest event left in the outbox at the end (0 when it is empty).
    lag_seconds: float = 0.0
    duration_seconds: float = 0.0
    #: Runs that looked at the outbox (the failed ones are `failed_runs`): a continuous relay
    #: runs when a commit's notification wakes it, after a batch, and at its backstop
    #: (PIN_RELAY_BACKSTOP_SECONDS) when nothing woke it.
    runs: int = 0
    #: A continuous relay's runs that failed (retried), and the error of the last one when no
    #: run succeeded after it: the relay ended while Kafka or PostgreSQL was failing.
    failed_runs: int = 0
    last_error: str | None = None
    #: Commit → Kafka per published event (its outbox row's creation to its transaction's
    #: commit), a uniform sample of at most LAG_SAMPLE events: the run's lag p50/p99.
    delivery_lags: Reservoir = field(
        default_factory=lambda: Reservoir(LAG_SAMPLE), repr=False, compare=False
    )

    def add_batch(self, published: Mapping[str, int], dead_lettered: Mapping[str, int]) -> None:
        """A batch's counts per topic."""
        self._add(published, dead_lettered)
        self.batches += 1

    def add_delivery_lags(self, lags: Sequence[float]) -> None:
        for lag in lags:
            self.delivery_lags.add(lag)

    def merge(self, later: RelaySummary) -> None:
        """Fold a later run in (a job relaying several times reports one total): counts add up,
        the backlog and the last error are the later run's (a run that succeeded has none)."""
        self._add(later.published_by_topic, later.dead_lettered_by_topic)
        self.batches += later.batches
        self.runs += later.runs
        self.recovered += later.recovered
        self.failed_runs += later.failed_runs
        self.pending, self.lag_seconds = later.pending, later.lag_seconds
        self.last_error = later.last_error
        self.duration_seconds += later.duration_seconds
        self.add_delivery_lags(later.delivery_lags.values)

    def failed(self, error: Exception) -> None:
        """A continuous relay's run that failed: counted, and its error kept until a later run
        succeeds (merge)."""
        self.failed_runs += 1
        self.last_error = str(error)

    @property
    def found_work(self) -> bool:
        """Published or dead-lettered anything: a continuous relay runs again at once, or else
        waits for a commit's notification (or its backstop)."""
        return bool(self.published or self.dead_lettered)

    def _add(self, published: Mapping[str, int], dead_lettered: Mapping[str, int]) -> None:
        for topic, count in published.items():
            self.published += count
            self.published_by_topic[topic] = self.published_by_topic.get(topic, 0) + count
        for topic, count in dead_lettered.items():
            self.dead_lettered += count
            self.dead_lettered_by_topic[topic] = self.dead_lettered_by_topic.get(topic, 0) + count

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        del data["delivery_lags"]
        data["lag_seconds"] = round(self.lag_seconds, 3)
        data["duration_seconds"] = round(self.duration_seconds, 3)
        data["delivery_lag_p50_seconds"] = self.delivery_lags.quantile(0.50)
        data["delivery_lag_p99_seconds"] = self.delivery_lags.quantile(0.99)
        return data
