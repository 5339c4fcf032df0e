"""Kafka client settings shared by the relay, the loader and the stack (confluent-kafka)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ClusterMetadata,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)

from pin_pipelines.config import (
    DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS,
    DEFAULT_KAFKA_PARTITIONS,
    Settings,
)
from pin_pipelines.errors import PinError
from pin_pipelines.kafka_properties import CAUSES, failure, read_properties

TOPIC_PROJECT = "pin.chessboard.project-upserted.v1"
TOPIC_LAYOUT = "pin.chessboard.layout-upserted.v1"
TOPIC_LAYOUT_GROUP = "pin.chessboard.layout-group-upserted.v1"
TOPIC_DEVSTATS_DLQ = "pin.dev-stats.dlq.v1"
#: Internal to the outbox relay: one receipt per Kafka transaction (pin_pipelines/relay/outbox.py).
TOPIC_RELAY_COMMITS = "pin.chessboard.outbox-relay-commits.v1"
ALL_TOPICS = (
    TOPIC_PROJECT,
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    TOPIC_DEVSTATS_DLQ,
    TOPIC_RELAY_COMMITS,
)
#: Topics made otherwise than the settings' partitions: the receipts, one partition, so the last
#: one is at its end; compacted, so the last one per key is kept forever, and segments roll hourly
#: so the compaction actually runs on a topic of small records. Replicated like every topic.
TOPIC_LAYOUTS: dict[str, tuple[int, dict[str, str]]] = {
    TOPIC_RELAY_COMMITS: (1, {"cleanup.policy": "compact", "segment.ms": "3600000"}),
}
#: The snapshot topics are changelogs (CONTRACT §9): compacted, so the newest snapshot of every
#: entity stays readable however old it is (a backfill into an empty dimension brings every group
#: back), and each version for min.compaction.lag.ms before a newer one may replace it.
CHANGELOG_TOPICS = (TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP)


def changelog_config(min_compaction_lag_ms: int) -> dict[str, str]:
    """The topic configs that make a topic a changelog."""
    return {"cleanup.policy": "compact", "min.compaction.lag.ms": str(min_compaction_lag_ms)}


@dataclass(frozen=True)
class TopicPolicy:
    """Partitions, replication factor and min.insync.replicas of the topics (the settings
    PIN_KAFKA_PARTITIONS, PIN_KAFKA_REPLICATION_FACTOR, PIN_KAFKA_MIN_INSYNC_REPLICAS). Unset,
    the replication factor is min(3, brokers) and min.insync.replicas one less (at least 1): a
    production cluster gets replicated topics that survive one broker, a dev broker still works."""

    partitions: int = DEFAULT_KAFKA_PARTITIONS
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    min_compaction_lag_ms: int = DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS

    @classmethod
    def from_settings(cls, settings: Settings) -> TopicPolicy:
        return cls(
            settings.kafka_partitions,
            settings.kafka_replication_factor,
            settings.kafka_min_insync_replicas,
            settings.kafka_min_compaction_lag_ms,
        )

    def resolve(self, brokers: int) -> TopicSpec:
        """The numbers for a cluster of `brokers` brokers."""
        rf = self.replication_factor or min(3, max(1, brokers))
        return TopicSpec(
            self.partitions,
            rf,
            self.min_insync_replicas or max(1, rf - 1),
            self.min_compaction_lag_ms,
        )


@dataclass(frozen=True)
class TopicSpec:
    partitions: int
    replication_factor: int
    min_insync_replicas: int
    min_compaction_lag_ms: int = DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS

    def for_topic(self, topic: str) -> tuple[int, dict[str, str]]:
        """Partitions and topic configs of `topic` (the receipts keep their one partition, the
        changelogs are compacted)."""
        partitions, config = TOPIC_LAYOUTS.get(topic, (self.partitions, {}))
        if topic in CHANGELOG_TOPICS:
            config = {**config, **changelog_config(self.min_compaction_lag_ms)}
        return partitions, {**config, "min.insync.replicas": str(self.min_insync_replicas)}


def client_config(bootstrap: str, own: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config of every Kafka client the project makes: `bootstrap.servers`, the properties
    of the file at PIN_KAFKA_CONFIG read now (TLS, SASL; none when unset), then the client's
    `own` settings, which its correctness rests on. librdkafka's errors go to an `error_cb`
    that keeps their cause for the one-line error (kafka_properties.failure), and its log lines
    stay quiet (debug events): the callers report failures themselves."""
    CAUSES.forget(bootstrap)
    return {
        "bootstrap.servers": bootstrap,
        **read_properties().values,
        **CAUSES.callbacks(bootstrap),
        **(own or {}),
    }


def admin(bootstrap: str, own: Mapping[str, Any] | None = None) -> AdminClient:
    return AdminClient(client_config(bootstrap, own))


def check_broker(bootstrap: str, timeout: float = 10.0) -> None:
    """One metadata request with the project's client settings (PIN_KAFKA_CONFIG's TLS and
    SASL), a broker still settling waited for within `timeout`: an unreachable or refusing
    broker is a PinError naming it and the cause (a worker's start, worker.check_services)."""
    _metadata(admin(bootstrap), bootstrap, timeout)


def broker_answers(bootstrap: str, timeout: float = 3.0) -> bool:
    try:
        admin(bootstrap).list_topics(timeout=timeout)
    except KafkaException:
        return False
    return True


#: Answers of a broker that is up but still settling after a restart or a topic's creation:
#: electing partition leaders, loading the group coordinators' offsets, a group rebalancing.
#: The local ones: a connection dropped and redialled, a coordinator still being looked up, the
#: handle of a broker that left the cluster destroyed under a call (a killed broker of three: the
#: call goes to the partition's new leader when retried). (librdkafka marks none of them
#: retriable on the exceptions of these calls.)
_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError._WAIT_COORD,
        KafkaError._TRANSPORT,
        KafkaError._DESTROY_BROKER,
    }
)

T = TypeVar("T")


def while_settling(call: Callable[[float], T], timeout: float = 10.0) -> T:
    """`call(seconds_left)`, retried until `timeout` while the broker answers with retriable or
    settling errors (for a few seconds after it restarted); any other error, or one that outlasts
    the timeout, is raised as it came. The call gets the time left, for its own timeout, so the
    whole stays within `timeout` (at least a second per attempt)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call(max(1.0, deadline - time.monotonic()))
        except KafkaException as exc:
            error = exc.args[0]
            settling = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _SETTLING
            )
            if not settling or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _metadata(client: AdminClient, bootstrap: str, timeout: float = 10.0) -> ClusterMetadata:
    """Topics and brokers; a broker still settling after a restart is waited for, not reported."""
    try:
        return while_settling(lambda left: client.list_topics(timeout=left), timeout)
    except KafkaException as exc:
        raise PinError(
            failure(bootstrap, f"Kafka at {bootstrap} is unreachable: {exc.args[0]}", client)
        ) from exc


def ensure_topics(
    bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS, policy: TopicPolicy | None = None
) -> list[str]:
    """Create missing topics (idempotent) after `policy`, by default the settings of the
    environment; returns the ones created. Existing topics are left as they are (check_topics)."""
    client = admin(bootstrap)
    metadata = _metadata(client, bootstrap)
    missing = [t for t in topics if t not in metadata.topics]
    if not missing:
        return []
    policy = policy or TopicPolicy.from_settings(Settings.from_env())
    spec = policy.resolve(len(metadata.brokers))
    new = []
    for topic in missing:
        partitions, config = spec.for_topic(topic)
        new.append(
            NewTopic(
                topic,
                num_partitions=partitions,
                replication_factor=spec.replication_factor,
                config=config,
            )
        )
    for topic, future in client.create_topics(new, operation_timeout=10).items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise PinError(
                    f"creating Kafka topic {topic} (replication factor "
                    f"{spec.replication_factor}, {len(metadata.brokers)} broker(s)) failed: {exc}"
                ) from exc
    _wait_until_led(client, bootstrap, missing)
    return missing


def _wait_until_led(
    client: AdminClient, bootstrap: str, topics: list[str], timeout: float = 15.0
) -> None:
    """A created topic reaches the brokers' metadata a moment later (on a cluster, each broker
    on its own): wait until every partition of each has a leader, so that the caller's next
    request (a produce, a check of the topics) does not find it missing."""
    deadline = time.monotonic() + timeout
    while True:
        metadata = _metadata(client, bootstrap)
        waiting = [
            t
            for t in topics
            if t not in metadata.topics
            or not metadata.topics[t].partitions
            or any(p.leader < 0 for p in metadata.topics[t].partitions.values())
        ]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise PinError(
                f"Kafka at {bootstrap} created {', '.join(waiting)} but shows no leader for"
                f" all of its partitions after {timeout:g}s"
            )
        time.sleep(0.2)


def check_topics(
    bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS, policy: TopicPolicy | None = None
) -> list[str]:
    """One line per existing topic weaker than `policy`: fewer partitions, a lower replication
    factor (of its least replicated partition) or a lower min.insync.replicas. Changes nothing:
    partitions are never removed, and adding some or replicas is the operator's decision
    (docs/runbook.md), since it moves keys between partitions or data between brokers."""
    client = admin(bootstrap)
    metadata = _metadata(client, bootstrap)
    spec = (policy or TopicPolicy.from_settings(Settings.from_env())).resolve(len(metadata.brokers))
    present = [t for t in topics if t in metadata.topics]
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in present]
    min_isr: dict[str, int] = {}
    for resource, future in (client.describe_configs(resources) if resources else {}).items():
        try:
            entry = future.result(timeout=15).get("min.insync.replicas")
        except KafkaException as exc:
            raise PinError(f"reading the configs of Kafka topic {resource.name}: {exc}") from exc
        if entry is not None and entry.value is not None:
            min_isr[resource.name] = int(entry.value)
    weaker = []
    for topic in present:
        partitions = metadata.topics[topic].partitions
        wanted_partitions, _ = spec.for_topic(topic)
        rf = min((len(p.replicas) for p in partitions.values()), default=0)
        found = {
            "partitions": (len(partitions), wanted_partitions),
            "replication factor": (rf, spec.replication_factor),
            "min.insync.replicas": (min_isr.get(topic, 1), spec.min_insync_replicas),
        }
        short = [f"{name} {has} < {wants}" for name, (has, wants) in found.items() if has < wants]
        if short:
            weaker.append(f"{topic}: {', '.join(short)}")
    return weaker


@dataclass(frozen=True)
class Changelogs:
    """What `compact_changelogs` did: the topics it changed, and one line per topic setting it
    left as the operator chose because the broker would refuse the change beside it."""

    changed: list[str]
    conflicts: list[str]


def compact_changelogs(
    bootstrap: str,
    topics: tuple[str, ...] = CHANGELOG_TOPICS,
    min_compaction_lag_ms: int = DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS,
) -> Changelogs:
    """Bring the existing `topics` to the changelog policy (changelog_config) in place, with an
    incremental config change: the topic, its id, offsets and other configs stay; a topic is
    never re-created. Topics already compacted with that lag are left alone.

    A topic whose own max.compaction.lag.ms (an operator's choice: pin never sets it) is below
    `min_compaction_lag_ms` keeps its min.compaction.lag.ms: the broker refuses a min above the
    max, and that refusal used to fail the whole change, the other topics' with it. It is still
    made compacted (the contract), and the conflict is one line naming both settings."""
    client = admin(bootstrap)
    present = [t for t in topics if t in _metadata(client, bootstrap).topics]
    wanted = changelog_config(min_compaction_lag_ms)
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in present]
    changes, conflicts = [], []
    for resource, future in (client.describe_configs(resources) if resources else {}).items():
        try:
            configs = future.result(timeout=15)
        except KafkaException as exc:
            raise PinError(f"reading the configs of Kafka topic {resource.name}: {exc}") from exc
        found = {name: entry.value for name, entry in configs.items()}
        differing = {name: value for name, value in wanted.items() if found.get(name) != value}
        conflict = _lag_conflict(resource.name, found, min_compaction_lag_ms)
        if conflict is not None and "min.compaction.lag.ms" in differing:
            del differing["min.compaction.lag.ms"]
            conflicts.append(conflict)
        if differing:
            entries = [
                ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
                for name, value in differing.items()
            ]
            changes.append(
                ConfigResource(
                    ConfigResource.Type.TOPIC, resource.name, incremental_configs=entries
                )
            )
    for resource, future in (client.incremental_alter_configs(changes) if changes else {}).items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            raise PinError(
                f"Kafka at {bootstrap}: making topic {resource.name} compacted failed: {exc}"
            ) from exc
    return Changelogs(sorted(r.name for r in changes), sorted(conflicts))


def _lag_conflict(topic: str, found: Mapping[str, str | None], min_lag_ms: int) -> str | None:
    """The line saying why `topic` keeps its min.compaction.lag.ms, or None when the broker
    would take `min_lag_ms` (it refuses a min.compaction.lag.ms above max.compaction.lag.ms)."""
    max_lag = found.get("max.compaction.lag.ms")
    if max_lag is None or int(max_lag) >= min_lag_ms:
        return None
    return (
        f"{topic}: min.compaction.lag.ms {min_lag_ms} (PIN_KAFKA_MIN_COMPACTION_LAG_MS) is above "
        f"the topic's max.compaction.lag.ms {max_lag}, which the broker refuses: "
        f"min.compaction.lag.ms left at {found.get('min.compaction.lag.ms')}; lower "
        f"PIN_KAFKA_MIN_COMPACTION_LAG_MS to {max_lag} or less, or raise the topic's "
        "max.compaction.lag.ms"
    )


def delete_topics(
    bootstrap: str, topics: tuple[str, ...], own: Mapping[str, Any] | None = None
) -> None:
    """Delete topics that exist (tests and benchmarks remove the private topics they made:
    hundreds of left-over topics slow every metadata request of a long-lived dev broker).
    `own`: the admin client's settings over the environment's (a listener of its own)."""
    client = admin(bootstrap, own)
    present = _metadata(client, bootstrap).topics
    existing = [t for t in topics if t in present]
    if not existing:  # the admin client refuses an empty list (ValueError)
        return
    for topic, future in client.delete_topics(existing, operation_timeout=10).items():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if "UNKNOWN_TOPIC_OR_PART" not in str(exc):
                raise PinError(f"deleting Kafka topic {topic} failed: {exc}") from exc
