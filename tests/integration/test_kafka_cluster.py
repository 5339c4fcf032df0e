"""Kafka as a production cluster, on the session's private 3-node KRaft cluster: replicated
topics and the migrate check, the relay and the loaders across a broker killed with SIGKILL, two
loaders splitting the partitions through a rebalance.

The cluster is the session's own (tests/support/kafka_cluster.py; never the shared broker on
9092): started once (~20 s on two cores) and reset for this module, every node stopped and reaped
at the session's end. Nodes killed by a test are started again by it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats.dim import groups
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import (
    ALL_TOPICS,
    TOPIC_LAYOUT_GROUP,
    TOPIC_RELAY_COMMITS,
    TopicPolicy,
    admin,
    check_topics,
)
from pin_pipelines.migrate import migrate_all
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.process import wait_until
from tests.support.cli import (
    PIN,
    assert_one_line_error,
    finish,
    load_summary,
    sample_until_done,
    stop_all,
)
from tests.support.devstats import Group, coordinator, group_at_end, group_offsets, shares
from tests.support.history import check, outbox_history, read_committed
from tests.support.kafka_cluster import (
    CLICKHOUSE_URL,
    NODES,
    cluster_settings,
    continuous_load,
    env_of,
    kill_node,
    leader,
    restore,
)
from tests.support.outbox import TOPICS, backlog, outbox_count
from tests.support.recalc import REPO_ROOT as ROOT
from tests.support.relay import assert_exactly_once_in_order

#: On one worker with test_kafka_partitions.py: the session's private cluster starts once for both.
pytestmark = pytest.mark.xdist_group("kafka-cluster")


@pytest.fixture
def settings(cluster: LocalKafkaCluster, pg_dsn: str, tmp_path: os.PathLike[str]) -> Settings:
    return cluster_settings(cluster, pg_dsn, tmp_path)


def test_topics_are_replicated_and_migrate_refuses_weaker_ones(
    cluster: LocalKafkaCluster, settings: Settings
) -> None:
    """Tried: the topics `pin db migrate` makes on 3 brokers with the default settings (6
    partitions, RF 3, min.insync.replicas 2; the receipts 1 partition, replicated), then the
    migration with PIN_KAFKA_PARTITIONS=12: it fails naming the weaker topics, passes with
    allow_weaker_topics reporting them, and leaves every topic as it was (never grown, shrunk or
    recreated)."""
    # Each broker learns of new topics on its own: the one answering may be a moment behind.
    client = admin(cluster.bootstrap)
    wait_until(
        lambda: set(ALL_TOPICS) <= set(client.list_topics(timeout=10).topics),
        timeout=30,
        what="every broker's metadata to list the topics",
    )
    metadata = client.list_topics(timeout=10)
    for topic in ALL_TOPICS:
        partitions = metadata.topics[topic].partitions
        assert len(partitions) == (1 if topic == TOPIC_RELAY_COMMITS else 6), topic
        assert {len(p.replicas) for p in partitions.values()} == {3}, topic
    assert check_topics(cluster.bootstrap, ALL_TOPICS, TopicPolicy()) == []

    stronger = Settings.from_env({**env_of(settings), "PIN_KAFKA_PARTITIONS": "12"})
    with pytest.raises(PinError, match=r"layout-group-upserted\.v1: partitions 6 < 12"):
        migrate_all(stronger)
    summary = migrate_all(stronger, allow_weaker_topics=True)
    assert len(summary["kafka_topics_weaker"]) == 4  # type: ignore[arg-type]
    assert "min.insync.replicas" not in str(summary["kafka_topics_weaker"])
    after = admin(cluster.bootstrap).list_topics(timeout=10).topics
    assert len(after[TOPIC_LAYOUT_GROUP].partitions) == 6


def test_relay_with_the_leader_killed_mid_run_loses_and_reorders_nothing(
    cluster: LocalKafkaCluster, settings: Settings, outbox: psycopg.Connection
) -> None:
    """Tried: `pin outbox relay --once` publishing 3,000 events (300 keys × versions 1..10) on RF 3
    / acks=all; once the first events are in Kafka, the leader of layout-group partition 0 is
    SIGKILLed and the cluster elects another. Runs again while it reports a failure. Then every
    outbox event is in Kafka exactly once for read_committed readers, per key in Version order
    (the history checker: nothing lost, duplicated, reordered or unexpected), and the outbox
    holds nothing (only acknowledged transactions are deleted)."""
    start = end_offsets(cluster.bootstrap, TOPICS)
    events = backlog(outbox, keys=300, versions=10)
    written = outbox_history(outbox)  # as committed, before the relay deletes it
    victim = leader(cluster.bootstrap, TOPIC_LAYOUT_GROUP, 0)
    relay = subprocess.Popen(
        # Transactions of 200 events: the kill lands while the relay is between the first
        # committed one and the last.
        [PIN, "outbox", "relay", "--once", "--batch-size", "200"],
        env=env_of(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: outbox_count(outbox) < 3000 or relay.poll() is not None,
            timeout=60,
            what="the relay's first transaction",
        )
        assert relay.poll() is None, "the relay finished before the kill"
        killed_at = time.monotonic()
        kill_node(cluster, victim)
        _, err = relay.communicate(timeout=120)
        wait_until(
            lambda: leader(cluster.bootstrap, TOPIC_LAYOUT_GROUP, 0) not in (victim, -1),
            timeout=60,
            what="a new leader for the killed one's partition",
        )
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait(timeout=30)
    attempts = [relay.returncode]
    while outbox_count(outbox) and len(attempts) < 4:
        rerun = subprocess.run(
            [PIN, "outbox", "relay", "--once"],
            env=env_of(settings),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        attempts.append(rerun.returncode)
        err = rerun.stderr
    assert outbox_count(outbox) == 0, f"relay runs {attempts}, last stderr: {err[-400:]}"
    print(f"leader {victim} killed; all relayed {time.monotonic() - killed_at:.1f}s later")
    assert len(written) == 3000
    check(written, read_committed(cluster.bootstrap, start, set(events))).assert_clean()
    restore(cluster)


# --- the loaders ----------------------------------------------------------------------------

#: `pin devstats load --once`, the CLI's own code path, with one seam: between two polls, once
#: the loader's group has committed offsets summing to `target`, the process writes them to
#: `marker` and waits until `go` exists. The test acts on the cluster there, mid-cycle: it kills a
#: broker, or starts a second loader, so a rebalance takes the partitions with a batch in hand.
PAUSED_LOAD = """
import contextlib, functools, json, sys, time
from pathlib import Path
from pin_pipelines import cli
from pin_pipelines.config import Settings
from pin_pipelines.devstats import loader
from pin_pipelines.devstats.offsets import DEFAULT_GROUP, committed_offsets, kafka_consumer
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP

target, marker, go = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
state = {"paused": False, "checked": 0.0}
reading = contextlib.ExitStack()  # a reader of the group's offsets that never joins it
reader = reading.enter_context(kafka_consumer(Settings.from_env().kafka_bootstrap, DEFAULT_GROUP))

def pause_once():
    if state["paused"] or time.monotonic() - state["checked"] < 0.01:
        return False
    state["checked"] = time.monotonic()
    found = committed_offsets(reader, TOPIC_LAYOUT_GROUP, range(6))
    if sum(max(0, tp.offset) for tp in found) < target:
        return False
    state["paused"] = True
    reading.close()
    marker.write_text(json.dumps({tp.partition: tp.offset for tp in found}))
    while not go.exists():
        time.sleep(0.02)
    return False

# Batches of 100: the target is reached with most of the cycle still to load, so a check between
# polls sees it. With batches of 1,000 (two inserts in flight) a whole cycle took ~0.3 s and could
# end before the commits reached the target.
loader.LoadOptions = functools.partial(loader.LoadOptions, should_stop=pause_once, batch_size=100)
try:
    code = cli.main(["devstats", "load", "--once"])
finally:  # an open reader kept the process from exiting after a cycle that never paused
    reading.close()
sys.exit(code)
"""

Delivered = dict[tuple[int, int], tuple[str, int]]  # (partition, offset) → (group Id, Version)


def produce_groups(
    bootstrap: str, groups_: list[Group], versions: range, rate: float | None = None
) -> Delivered:
    """The `versions` of each group, version-major (a group's versions far apart in its
    partition, as a busy drain writes them), then a stale repeat of the first one (an older
    event arriving late: the version guard must skip it). acks=all, as the relay writes; at most
    `rate` events/s when given (a steady flow, as a continuous relay publishes). Returns where
    each event landed."""
    delivered: Delivered = {}

    def landed(err: Any, msg: Any) -> None:
        assert err is None, err
        body = json.loads(msg.value())
        delivered[(msg.partition(), msg.offset())] = (body["Id"], body["Version"])

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    begin, sent = time.monotonic(), 0
    for version in [*versions, versions[0]]:
        for group in groups_:
            event = group.event(version)
            producer.produce(
                TOPIC_LAYOUT_GROUP,
                key=event["Id"].encode(),
                value=json.dumps(event).encode(),
                on_delivery=landed,
            )
            producer.poll(0)
            sent += 1
            if rate is not None and sent % 100 == 0:
                time.sleep(max(0.0, begin + sent / rate - time.monotonic()))
    assert producer.flush(60) == 0
    return delivered


def stored_versions(developer: uuid.UUID) -> dict[str, int]:
    """Each group's highest stored Version, merged or not (what the guard compares against)."""
    with open_clickhouse(CLICKHOUSE_URL) as ch:
        rows = ch.rows(
            "SELECT toString(LayoutGroupId), max(SourceVersion) FROM "
            "pin_dev_stats.dim_layout_group WHERE DeveloperId = %(d)s GROUP BY LayoutGroupId",
            {"d": developer},
        )
    return {str(gid): int(version) for gid, version in rows}


def assert_committed_are_stored(bootstrap: str, developer: uuid.UUID, sent: Delivered) -> int:
    """Every event below the group's committed offsets is in ClickHouse (its group stored at its
    Version or newer). The offsets are read first: the dimension only grows, so a commit made
    before the rows were stored shows here. Returns how many events the commits cover."""
    committed = group_offsets(bootstrap)
    stored = stored_versions(developer)
    covered = [(gid, v) for (p, o), (gid, v) in sent.items() if o < committed.get(p, -1)]
    behind = [(gid, v) for gid, v in covered if stored.get(gid, 0) < v]
    assert not behind, f"{len(behind)} committed events not in ClickHouse, e.g. {behind[:3]}"
    return len(covered)


def assert_loaded_exactly(bootstrap: str, developer: uuid.UUID, sent: Delivered) -> None:
    """The end state: the group's offsets at the topic's end (nothing skipped), the argMax read
    of each group at its last Version (the stale repeats skipped), no Version stored twice."""
    ends = end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
    assert group_offsets(bootstrap) == ends
    last: dict[str, int] = {}
    for gid, version in sent.values():
        last[gid] = max(version, last.get(gid, 0))
    with open_clickhouse(CLICKHOUSE_URL) as ch:
        read = {str(g.layout_group_id): g.source_version for g in groups(ch, developer)}
        rows = ch.rows(
            "SELECT toString(LayoutGroupId), SourceVersion, count() FROM "
            "pin_dev_stats.dim_layout_group WHERE DeveloperId = %(d)s "
            "GROUP BY LayoutGroupId, SourceVersion HAVING count() > 1",
            {"d": developer},
        )
    assert read == last
    assert rows == [], f"versions stored twice: {rows[:3]}"


def paused_load(
    settings: Settings, target: int, tmp_path: Path
) -> tuple[subprocess.Popen[str], Path, Path]:
    """A PAUSED_LOAD process; returns it with its marker and go files."""
    marker, go = (
        tmp_path / f"paused-{uuid.uuid4().hex[:6]}",
        tmp_path / f"go-{uuid.uuid4().hex[:6]}",
    )
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSED_LOAD, str(target), str(marker), str(go)],
        cwd=ROOT,
        env=env_of(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, marker, go


def wait_paused(process: subprocess.Popen[str], marker: Path) -> dict[int, int]:
    try:
        wait_until(
            lambda: marker.exists() or process.poll() is not None,
            timeout=90,
            what="the loader pausing mid-cycle",
        )
    except PinError as exc:  # say what the loader was doing (its log lines are on stderr)
        process.kill()
        stderr = process.communicate()[1][-3000:]
        raise AssertionError(f"{exc}; the loader's stderr: {stderr}") from exc
    assert process.poll() is None, f"the loader ended before its pause: {process.communicate()}"
    time.sleep(0.1)  # the marker's text is written
    return {int(p): o for p, o in json.loads(marker.read_text()).items()}


def test_loader_with_the_group_coordinator_killed_mid_cycle_ends_exact(
    cluster: LocalKafkaCluster, settings: Settings, tmp_path: Path
) -> None:
    """Tried: 7,500 events (1,500 groups × versions 1..4, then a stale version 1 of each) loaded
    by `pin devstats load --once` into the server dimension; once the group has committed a
    fifth of them, the node coordinating the group (leading partitions of the topic too) is
    SIGKILLed mid-cycle. While the loader goes on against the two others, the committed offsets
    are sampled: every event they cover is in ClickHouse already. The node restarted and one
    more load run: the group is at the topic's end, each group reads at its last Version, no
    Version stored twice."""
    start = group_at_end(cluster.bootstrap)
    developer = uuid.uuid4()
    sent = produce_groups(
        cluster.bootstrap, [Group(developer_id=developer) for _ in range(1500)], range(1, 5)
    )
    victim = coordinator(cluster.bootstrap)
    loader, marker, go = paused_load(settings, sum(start.values()) + 1500, tmp_path)
    samples = []
    try:
        at_pause = wait_paused(loader, marker)
        assert sum(at_pause.values()) - sum(start.values()) < len(sent)  # mid-cycle
        samples.append(assert_committed_are_stored(cluster.bootstrap, developer, sent))
        kill_node(cluster, victim)
        go.touch()

        def sample() -> None:
            with contextlib.suppress(PinError):  # no sample while the coordinator moves
                samples.append(assert_committed_are_stored(cluster.bootstrap, developer, sent))

        first = sample_until_done(loader, sample, timeout=120)
    finally:
        stop_all(loader)
        restore(cluster)
    print(f"node {victim} killed; commits covered {samples} events; first run {first.stdout}")
    assert_committed_are_stored(cluster.bootstrap, developer, sent)
    again = load_summary(finish(subprocess.Popen(
        [PIN, "devstats", "load", "--once"], env=env_of(settings),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ), timeout=120))  # fmt: skip
    assert again["complete"]
    assert_loaded_exactly(cluster.bootstrap, developer, sent)
    # Two brokers of three still serve every partition: the run across the kill should succeed.
    assert load_summary(first)["complete"]


def test_two_continuous_loaders_split_the_partitions_through_a_rebalance(
    cluster: LocalKafkaCluster, settings: Settings
) -> None:
    """Tried: 24,000 events (4,000 groups × versions 1..5, then a stale version 1 of each)
    produced at 1,200 events/s while continuous loaders of one group (`pin devstats load`) load
    them: A from the start, B once the group has committed 2,000 while events still arrive, so
    the group rebalances while A has batches in hand (it stores and commits them before it lets
    its partitions go). The coordinator's assignment then gives each loader a share of the 6
    partitions, while events are still produced. Once the group is at the topic's end both stop
    on SIGTERM: each consumed a part, together each event once, the group's offsets are the end
    offsets, the reads are exact and no Version is stored twice."""
    start = group_at_end(cluster.bootstrap)
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(4000)]
    sent: Delivered = {}
    producer = threading.Thread(
        target=lambda: sent.update(
            produce_groups(cluster.bootstrap, history, range(1, 6), rate=1200)
        )
    )
    first, second = continuous_load(settings), None
    split: list[set[int]] = []
    try:
        producer.start()
        wait_until(
            lambda: (
                sum(group_offsets(cluster.bootstrap).values()) >= sum(start.values()) + 2000
                or first.poll() is not None
            ),
            timeout=90,
            what="loader A committing its first 2,000 events",
        )
        assert first.poll() is None, f"loader A ended: {first.communicate()}"
        assert producer.is_alive(), "every event produced before B joined"
        second = continuous_load(settings)

        def both_hold_partitions() -> bool:
            split[:] = shares(cluster.bootstrap)
            return len(split) == 2 and all(split)

        wait_until(both_hold_partitions, timeout=90, what="B joining, both holding partitions")
        split_while_producing = producer.is_alive()
        producer.join(timeout=120)
        ends = end_offsets(cluster.bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
        wait_until(
            lambda: group_offsets(cluster.bootstrap) == ends,
            timeout=120,
            what="the group's offsets at the topic's end",
        )
        for loader in (first, second):
            loader.send_signal(signal.SIGTERM)
        a = load_summary(finish(first, timeout=60))
        b = load_summary(finish(second, timeout=60))
    finally:
        stop_all(first, *([second] if second else []))
        producer.join()
    print(f"split {split}; loader A {a}; loader B {b}")
    assert len(sent) == 24_000
    assert split_while_producing, "the group settled only after the last event was produced"
    assert sorted(p for share in split for p in share) == list(range(6))
    assert a["consumed"] > 0 and b["consumed"] > 0
    assert a["consumed"] + b["consumed"] == len(sent)  # nothing read twice
    assert a["complete"] and b["complete"]
    assert_loaded_exactly(cluster.bootstrap, developer, sent)


#: How long a `pin` run may take to give up on a dead cluster: the relay's delivery timeout
#: (30 s) and the loader's Kafka timeouts (10 s per call, 30 s to join), with room to spare.
GIVE_UP_WITHIN = 75.0


def test_whole_cluster_down_past_the_run_budget_is_one_line_and_the_next_runs_resume(
    cluster: LocalKafkaCluster, settings: Settings, outbox: psycopg.Connection, tmp_path: Path
) -> None:
    """Tried: every node SIGKILLed while `pin devstats load --once` is mid-cycle (10,000 events,
    1,000 or more committed) and while `pin outbox relay --once` has 400 events to publish; the
    cluster stays down until both gave up. Each exits non-zero with one line naming Kafka, no
    traceback, within GIVE_UP_WITHIN; the outbox keeps its events, the loader's commits cover
    only stored rows. The cluster back: one more run of each delivers everything, exactly."""
    start = group_at_end(cluster.bootstrap)
    published_from = end_offsets(cluster.bootstrap, TOPICS)
    developer = uuid.uuid4()
    sent = produce_groups(
        cluster.bootstrap, [Group(developer_id=developer) for _ in range(2000)], range(1, 5)
    )
    events = backlog(outbox, keys=100, versions=4)
    loader, marker, go = paused_load(settings, sum(start.values()) + 1000, tmp_path)
    relay = None
    try:
        wait_paused(loader, marker)
        for node_id in range(1, NODES + 1):
            kill_node(cluster, node_id)
        killed = time.monotonic()
        go.touch()
        relay = subprocess.Popen(
            [PIN, "outbox", "relay", "--once"], env=env_of(settings),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        relayed = finish(relay, timeout=GIVE_UP_WITHIN)
        loaded = finish(loader, timeout=max(1.0, GIVE_UP_WITHIN - (time.monotonic() - killed)))
        for result in (relayed, loaded):
            assert_one_line_error(result, f"Kafka at {cluster.bootstrap}")
        assert outbox_count(outbox) == len(events) * 4
    finally:
        stop_all(loader, *([relay] if relay else []))
        restore(cluster)
    assert_committed_are_stored(cluster.bootstrap, developer, sent)

    for command in (["outbox", "relay", "--once"], ["devstats", "load", "--once"]):
        again = subprocess.run(
            [PIN, *command], env=env_of(settings), capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert again.returncode == 0, f"{command}: {again.stderr[-600:]}"
    assert outbox_count(outbox) == 0
    assert_exactly_once_in_order(cluster.bootstrap, published_from, events)
    assert_loaded_exactly(cluster.bootstrap, developer, sent)
