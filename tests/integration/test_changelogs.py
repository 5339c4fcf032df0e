"""Months in production (CONTRACT §9): the snapshot topics are compacted changelogs, made so in
place by `pin db migrate`; a backfill after compaction still brings every group back; a loader
whose group lost its offsets resumes from the earliest retained offset.

The Kafka broker is the session's private one (tests/support/private_kafka.py): the tests create,
alter and delete the product's own topic names and the loader's consumer group, which on the
shared broker belong to every other session's `pin serve`."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from pin_pipelines.config import DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS
from pin_pipelines.devstats.offsets import DEFAULT_GROUP
from pin_pipelines.kafka import (
    CHANGELOG_TOPICS,
    TOPIC_LAYOUT,
    TOPIC_LAYOUT_GROUP,
    admin,
)
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.cli import run_pin
from tests.support.devstats import Group, produce_events, read_all
from tests.support.loaders import stored_groups
from tests.support.private_kafka import without_topics

#: Topic configs that make the broker's log cleaner compact within seconds: segments roll after
#: 100 ms, any dirty share is worth cleaning, no version is protected by a lag.
EAGER_COMPACTION = {
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "100",
}


def _env(kafka_bootstrap: str, pg_dsn: str, tmp_path: Path) -> dict[str, str]:
    return {
        "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "PIN_PG_DSN": pg_dsn,
        "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
        "PIN_STATE_DIR": str(tmp_path / "state"),
        "PIN_KAFKA_PARTITIONS": "2",
    }


def _summary(*args: str, env: dict[str, str]) -> dict[str, object]:
    result = run_pin(*args, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _configs(bootstrap: str, topic: str) -> dict[str, str | None]:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    client = admin(bootstrap)  # alive until the answer: a collected client fails its futures
    found = client.describe_configs([resource])[resource].result(timeout=15)
    return {name: entry.value for name, entry in found.items()}


def _alter(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    entries = [
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        for name, value in configs.items()
    ]
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=entries)
    client = admin(bootstrap)
    client.incremental_alter_configs([resource])[resource].result(timeout=15)


def _topic_ids(bootstrap: str, topics: tuple[str, ...]) -> dict[str, str]:
    client = admin(bootstrap)
    found = client.describe_topics(TopicCollection(list(topics)))
    return {topic: str(future.result(timeout=15).topic_id) for topic, future in found.items()}


def _readable(bootstrap: str, topic: str, timeout: float = 30.0) -> int:
    """How many messages of `topic` a reader from its beginning gets (read_all's one message a
    poll is too slow for a topic of thousands)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending, count = set(partitions), 0
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=10_000, timeout=0.5):
                err = msg.error()
                if err is None:
                    count += 1
                elif err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
        assert not pending, f"{topic}: partitions {pending} did not reach their end"
        return count
    finally:
        consumer.close()


def test_migrate_makes_existing_snapshot_topics_compacted_in_place(
    kafka: LocalKafka,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: the three snapshot topics created as before (cleanup.policy=delete), a message in
    each, then `pin db migrate`. It makes each a compacted changelog (min.compaction.lag.ms the
    setting's 7-day default) with an incremental config change, and its JSON summary lists them
    under `kafka_topics_compacted`: the same topics (topic ids unchanged), their messages still
    there at the same offsets. A second migrate changes nothing and says so. Before, migrate
    left an existing topic's cleanup policy as it was."""
    bootstrap = kafka.settings.kafka_bootstrap
    client = admin(bootstrap)
    without_topics(bootstrap, CHANGELOG_TOPICS)
    created = client.create_topics(
        [NewTopic(t, 2, 1, config={"cleanup.policy": "delete"}) for t in CHANGELOG_TOPICS]
    )
    for future in created.values():
        future.result(timeout=15)
    group = Group()
    for topic in CHANGELOG_TOPICS:
        produce_events(bootstrap, topic, [group.event(1), group.event(2)])
    ids = _topic_ids(bootstrap, CHANGELOG_TOPICS)
    env = _env(bootstrap, pg_dsn, tmp_path)

    summary = _summary("db", "migrate", env=env)

    assert summary["kafka_topics_compacted"] == sorted(CHANGELOG_TOPICS)
    assert _topic_ids(bootstrap, CHANGELOG_TOPICS) == ids
    for topic in CHANGELOG_TOPICS:
        configs = _configs(bootstrap, topic)
        assert (configs["cleanup.policy"], configs["min.compaction.lag.ms"]) == (
            "compact",
            str(DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS),
        )
        assert [json.loads(m.value or b"")["Version"] for m in read_all(bootstrap, topic)] == [
            1,
            2,
        ]
    assert _summary("db", "migrate", env=env)["kafka_topics_compacted"] == []


def test_migrate_keeps_a_max_compaction_lag_the_operator_set_and_says_so_in_one_line(
    kafka: LocalKafka,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: the three snapshot topics created with the delete policy, the layout topic with an
    operator's max.compaction.lag.ms of one day (and min.compaction.lag.ms 0), below the
    setting's 7-day min.compaction.lag.ms; then `pin db migrate`, twice. Before, the broker
    refused the layout topic's change (a min above the max), every topic's change with it, and
    migrate failed saying the topics "were not created" (they existed). Now it exits 0: every
    topic is compacted, the other two with the setting's lag, the layout topic keeps the
    operator's two settings, and one line of the summary's `kafka_topics_conflicts` (and a
    warning line on stderr) names the topic and both settings. The second migrate changes
    nothing and reports the same conflict."""
    bootstrap = kafka.settings.kafka_bootstrap
    client = admin(bootstrap)
    without_topics(bootstrap, CHANGELOG_TOPICS)
    one_day = str(24 * 3600 * 1000)
    operator = {"max.compaction.lag.ms": one_day, "min.compaction.lag.ms": "0"}
    created = client.create_topics(
        [
            NewTopic(t, 2, 1, config={"cleanup.policy": "delete", **operator})
            if t == TOPIC_LAYOUT
            else NewTopic(t, 2, 1, config={"cleanup.policy": "delete"})
            for t in CHANGELOG_TOPICS
        ]
    )
    for future in created.values():
        future.result(timeout=15)
    env = _env(bootstrap, pg_dsn, tmp_path)

    first = run_pin("db", "migrate", env=env, timeout=240)

    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["kafka_topics_compacted"] == sorted(CHANGELOG_TOPICS)
    [conflict] = summary["kafka_topics_conflicts"]
    assert conflict.startswith(f"{TOPIC_LAYOUT}: min.compaction.lag.ms ")
    assert "PIN_KAFKA_MIN_COMPACTION_LAG_MS" in conflict
    assert f"the topic's max.compaction.lag.ms {one_day}" in conflict
    warnings = [line for line in first.stderr.splitlines() if "kafka_topic_config_conflict" in line]
    assert len(warnings) == 1 and TOPIC_LAYOUT in warnings[0], first.stderr
    for topic in CHANGELOG_TOPICS:
        configs = _configs(bootstrap, topic)
        lags = (configs["min.compaction.lag.ms"], configs["max.compaction.lag.ms"])
        assert configs["cleanup.policy"] == "compact"
        if topic == TOPIC_LAYOUT:
            assert lags == ("0", one_day)
        else:
            assert lags[0] == str(DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS)

    again = _summary("db", "migrate", env=env)
    assert again["kafka_topics_compacted"] == []
    assert again["kafka_topics_conflicts"] == [conflict]


def test_a_backfill_after_compaction_brings_back_the_newest_snapshot_of_every_group(
    kafka: LocalKafka,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: 300 groups of one developer published in 5 versions each, on the layout-group
    topic as `pin db migrate` makes it (compacted) with the cleaner made eager (EAGER_COMPACTION),
    until the log cleaner has dropped older versions (fewer messages readable than published:
    waited for with a deadline). Then `pin devstats backfill` into an empty dimension: every
    group is there at version 5, nothing else; what compaction dropped was only what a newer
    version replaced."""
    bootstrap = kafka.settings.kafka_bootstrap
    env = _env(bootstrap, pg_dsn, tmp_path)
    without_topics(bootstrap, (TOPIC_LAYOUT_GROUP,))
    _summary("db", "migrate", env=env)  # creates it compacted, and the empty dimension
    assert _configs(bootstrap, TOPIC_LAYOUT_GROUP)["cleanup.policy"] == "compact"
    _alter(bootstrap, TOPIC_LAYOUT_GROUP, EAGER_COMPACTION)
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(300)]
    versions = 5
    for version in range(1, versions + 1):
        produce_events(bootstrap, TOPIC_LAYOUT_GROUP, [g.event(version) for g in history])
        # Not a wait for a condition: a segment rolls once segment.ms has passed at an append,
        # so each version lands in a segment of its own, which the cleaner may then compact.
        time.sleep(0.2)
    produce_events(bootstrap, TOPIC_LAYOUT_GROUP, [history[0].event(versions)])  # rolls the last
    published = len(history) * versions + 1
    wait_until(
        lambda: _readable(bootstrap, TOPIC_LAYOUT_GROUP) < published,
        timeout=90,
        what="the log cleaner compacting the layout-group topic",
    )

    summary = _summary("devstats", "backfill", env=env)

    assert int(str(summary["consumed"])) < published
    assert stored_groups(env["PIN_CLICKHOUSE_URL"], developer) == {
        (g.id, versions) for g in history
    }


def test_a_loader_whose_group_lost_its_offsets_resumes_from_the_earliest_offset(
    kafka: LocalKafka,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: `pin devstats load --once` loads 50 groups at version 2 and commits; the group's
    committed offsets are then deleted as their expiry (offsets.retention.minutes) deletes them
    (the consumer group deleted), and 10 more groups published. The next load starts from the
    earliest retained offset (the loader's auto.offset.reset is `earliest`): it reads every
    event again, the version guard skips what is stored (skipped_stale), the 10 new groups are
    inserted, no error, nothing lost. This already held before; the test keeps it so."""
    bootstrap = kafka.settings.kafka_bootstrap
    env = _env(bootstrap, pg_dsn, tmp_path)
    without_topics(bootstrap, (TOPIC_LAYOUT_GROUP,))  # and the group's offsets in it
    _summary("db", "migrate", env=env)
    developer = uuid.uuid4()
    first = [Group(developer_id=developer) for _ in range(50)]
    produce_events(bootstrap, TOPIC_LAYOUT_GROUP, [g.event(v) for v in (1, 2) for g in first])
    loaded = _summary("devstats", "load", "--once", env=env)
    assert loaded["complete"] is True

    client = admin(bootstrap)
    deleted = client.delete_consumer_groups([DEFAULT_GROUP], request_timeout=15)
    for future in deleted.values():
        future.result(timeout=15)
    later = [Group(developer_id=developer) for _ in range(10)]
    produce_events(bootstrap, TOPIC_LAYOUT_GROUP, [g.event(1) for g in later])

    again = _summary("devstats", "load", "--once", env=env)

    assert again["complete"] is True
    assert again["inserted"] == len(later)
    assert int(str(again["skipped_stale"])) >= 2 * len(first)
    assert stored_groups(env["PIN_CLICKHOUSE_URL"], developer) == {(g.id, 2) for g in first} | {
        (g.id, 1) for g in later
    }
